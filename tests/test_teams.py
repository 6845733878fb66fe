"""Loading team eval sets: the shipped examples, and clear errors on bad input."""

import json
import os
import shutil
from pathlib import Path

import pytest

from quantgate import checks
from quantgate.errors import QuantgateError
from quantgate.stats import tango_bounds
from quantgate.teams import load_team, load_teams
from tests.conftest import REPO


def test_examples_load(example_evals):
    teams = {t.name: t for t in load_teams(example_evals)}
    assert sorted(teams) == ["billing", "search", "support"]
    assert teams["support"].policy.margin.points(0.8) == pytest.approx(0.08)  # relative 10 %
    assert teams["search"].policy.margin.points(0.3) == 0.05
    task = teams["search"].tasks[0]
    assert task.name == "search_capitals"
    assert task.config["dataset_kwargs"]["data_files"]["test"].endswith("evals/search/data.jsonl")
    assert {n: t.tasks[0].n_docs for n, t in teams.items()} == {"billing": 289, "search": 216, "support": 304}


def test_digest_changes_with_data_only_for_that_team(example_evals):
    before = {t.name: t.digest for t in load_teams(example_evals)}
    with open(example_evals / "billing" / "data.jsonl", "a") as f:
        f.write('{"id": "x", "question": "What is 123 + 456?", "answer": "579"}\n')
    after = {t.name: t.digest for t in load_teams(example_evals)}
    assert after["billing"] != before["billing"]
    assert after["search"] == before["search"] and after["support"] == before["support"]


BAD = sorted(p.name for p in (REPO / "tests" / "bad_evals").iterdir())


def overlay(evals: Path, case: str) -> str:
    """Copy tests/bad_evals/<case>/<team>/* over the example sets; return the expected message."""
    src = REPO / "tests" / "bad_evals" / case
    for f in src.rglob("*"):
        if f.is_file() and f.name != "EXPECTED":
            (evals / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, evals / f.relative_to(src))
    return (src / "EXPECTED").read_text().strip()


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_named_with_file_line_and_fix(example_evals, case):
    expected = overlay(example_evals, case)
    with pytest.raises(QuantgateError) as err:
        load_teams(example_evals)
    assert expected in str(err.value)
    team = next(p.name for p in (REPO / "tests" / "bad_evals" / case).iterdir() if p.is_dir())
    assert f"team {team}:" in str(err.value)


def test_a_group_yaml_or_an_empty_one_is_named_as_such_in_one_short_line(example_evals, tmp_path):
    """A group YAML (`group:` with a `task:` list) was told "`task:` must be the task's name (a string), got [...]"
    with the whole inline list printed, and an empty task YAML "got a NoneType"; each is now one short line saying
    what the file is."""
    from quantgate.teams import _not_a_task

    expected = overlay(example_evals, "task_group")
    with pytest.raises(QuantgateError) as err:
        load_teams(example_evals)
    assert [line for line in str(err.value).splitlines() if "all.yaml" in line] == [f"  {example_evals}/{expected}"]
    path = tmp_path / "t.yaml"
    path.write_text("task:\n  - a\n  - b\n")
    assert _not_a_task(path, {"task": ["a", "b"]}).startswith(f"{path}:1: an lm-eval group (lm-eval reads a YAML")
    long_task = {"task": {"name": "x" * 100}}
    assert _not_a_task(path, long_task).endswith("got a dict; name shared templates with a leading _")
    assert _not_a_task(path, None).startswith(f"{path}: holds no task (no YAML in it, comments only, or null); ")


def test_validate_cli_prints_every_problem_and_exits_nonzero(example_evals):
    from click.testing import CliRunner

    from cli.main import cli

    expected = [overlay(example_evals, "blank_line"), overlay(example_evals, "negative_margin")]
    res = CliRunner().invoke(cli, ["evals", "validate", str(example_evals)])
    assert res.exit_code == 1
    assert all(e in res.output for e in expected) and "Traceback" not in res.output
    ok = CliRunner().invoke(cli, ["evals", "validate", str(example_evals / "billing")])
    assert ok.exit_code == 0 and "ok: billing (billing_arithmetic, 289 docs)" in ok.output


def test_oversize_file_refused(example_evals, monkeypatch):
    monkeypatch.setattr(checks, "MAX_DATA_BYTES", 1000)
    with pytest.raises(QuantgateError, match=r"search/data.jsonl: \d+ bytes is over the 1000 byte limit"):
        load_team(example_evals / "search")


def test_min_docs_matches_the_gate_statistics():
    for margin, conf in [(0.05, 0.95), (0.08, 0.95), (0.02, 0.9), (0.1, 0.99)]:
        n = checks.min_docs_to_pass(margin, conf)
        assert tango_bounds(0, 0, n, conf)[1] <= margin < tango_bounds(0, 0, n - 1, conf)[1]
    assert checks.min_docs_to_pass(0.05, 0.95) == 52


def test_template_fields():
    assert checks.template_fields(
        {"doc_to_text": "Q: {{ q }} {{ ctx | upper }}", "doc_to_target": "answer", "doc_to_choice": ["a", "b"]}
    ) == {"doc_to_text": {"q", "ctx"}, "doc_to_target": {"answer"}}


def test_new_team_scaffold_validates_with_the_others(example_evals):
    from click.testing import CliRunner

    from cli.main import cli

    res = CliRunner().invoke(
        cli, ["evals", "new", "ranking", "--owner", "Ranking", "--contact", "r@x", "--root", str(example_evals)]
    )
    assert res.exit_code == 0, res.output
    teams = {t.name: t for t in load_teams(example_evals)}
    assert teams["ranking"].tasks[0].n_docs == checks.min_docs_to_pass(0.05, 0.95) + 8
    assert teams["ranking"].policy.owner == "Ranking"
    again = CliRunner().invoke(
        cli, ["evals", "new", "ranking", "--owner", "a", "--contact", "b", "--root", str(example_evals)]
    )
    assert again.exit_code == 1 and "already exists" in again.output
    bad = CliRunner().invoke(
        cli, ["evals", "new", "Bad-Name", "--owner", "a", "--contact", "b", "--root", str(example_evals)]
    )
    assert bad.exit_code == 2 and bad.output.splitlines()[-1] == (  # a usage error, before anything is read
        "Error: Invalid value for 'TEAM': 'Bad-Name': use lower_snake_case, 2-40 characters, starting with a letter "
        "(it names the team in tags and reports)"
    ), bad.output


@pytest.mark.parametrize(
    "owner, contact, said",
    [
        (
            "",
            "c",
            "Error: Invalid value for '--owner': it is blank; say whom the gate reports to, e.g. --owner Ranking",
        ),
        (
            "O",
            "  ",
            "Error: Invalid value for '--contact': it is blank; say whom the gate reports to, e.g. --contact "
            "ranking-oncall@example.com",
        ),
        (
            " ",
            "",
            "Error: Invalid value for '--owner': it is blank; say whom the gate reports to, e.g. --owner Ranking",
        ),
    ],
)
def test_new_team_names_the_option_left_blank_and_a_missing_root(tmp_path, owner, contact, said):
    """A blank --owner with a good --contact was refused as "--owner and --contact must not be empty"; a --root that
    does not exist was "not a folder", then an error (exit 1), not the usage error (exit 2) of a bad argument."""
    from click.testing import CliRunner

    from cli.main import cli

    args = ["evals", "new", "ranking", "--owner", owner, "--contact", contact, "--root", str(tmp_path)]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2 and res.output.splitlines()[-1] == said and list(tmp_path.iterdir()) == []
    res = CliRunner().invoke(cli, [*args[:3], "--owner", "O", "--contact", "c", "--root", str(tmp_path / "none")])
    # exit 1 (an error) where README's convention gives 2 for a bad argument: a usage error naming --root now
    assert res.exit_code == 2 and res.output.splitlines()[-1] == (
        f"Error: Invalid value for '--root': {tmp_path / 'none'} does not exist; give the folder that holds the "
        "team folders (evals/)"
    ), res.output
    (tmp_path / "a-file").write_text("")
    res = CliRunner().invoke(cli, [*args[:3], "--owner", "O", "--contact", "c", "--root", str(tmp_path / "a-file")])
    assert res.exit_code == 2 and res.output.splitlines()[-1].endswith(
        "a-file is not a folder; give the folder that holds the team folders (evals/)"
    ), res.output


def test_new_team_without_evals_here_says_so_before_asking_owner_and_contact(tmp_path, monkeypatch):
    """`evals new ranking` outside the project folder (no evals/ there) asked for the owner and the contact, then
    refused the default --root, not named as the default."""
    from click.testing import CliRunner

    from cli.main import cli

    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["evals", "new", "ranking"], input="O\nc@example.com\n")
    assert res.exit_code == 2 and "Owner" not in res.output, res.output
    assert res.output.splitlines()[-1] == (
        "Error: Invalid value for '--root': evals does not exist (the default: run this in the project folder, or "
        "give --root); give the folder that holds the team folders (evals/)"
    )
    assert list(tmp_path.iterdir()) == []


def test_scaffold_example_documents_are_distinct_and_validate_for_many_names():
    import yaml

    from quantgate.scaffold import TASK, example_docs

    n = checks.min_docs_to_pass(0.05, 0.95) + 8
    config = yaml.safe_load(TASK.format(name="x"))
    for i in range(300):  # 42 of t0..t199 drew a number pair twice: validate refused their scaffold
        docs = example_docs(f"t{i}", n)
        assert len({d["question"] for d in docs}) == n
        found, _ = checks.check_data(config, Path("data.jsonl"), [(k, d, d) for k, d in enumerate(docs, 1)], str)
        assert found == [], (f"t{i}", found)


@pytest.mark.parametrize("name", ["t3", "billing"])
def test_new_team_validates_for_names_whose_draw_repeated_a_pair(tmp_path, name):
    from click.testing import CliRunner

    from cli.main import cli

    res = CliRunner().invoke(cli, ["evals", "new", name, "--owner", "O", "--contact", "c", "--root", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert f"created {tmp_path / name}: " in res.output and "(60 example docs)" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no staging folder left beside it


def test_a_scaffold_that_does_not_validate_leaves_nothing_behind(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from cli.main import cli
    from quantgate import scaffold

    real = scaffold.example_docs
    monkeypatch.setattr(scaffold, "example_docs", lambda name, n: real(name, n - 1) + real(name, 1))
    args = ["evals", "new", "ranking", "--owner", "O", "--contact", "c", "--root", str(tmp_path)]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 1 and "data.jsonl:60: repeats the document of line 1" in res.output
    assert list(tmp_path.iterdir()) == []  # neither the team folder nor the hidden one it was written in
    monkeypatch.setattr(scaffold, "example_docs", real)
    again = CliRunner().invoke(cli, args)  # a rerun is not told the folder already exists
    assert again.exit_code == 0, again.output


def test_a_fifo_data_file_or_task_file_is_named_as_one_not_read(example_evals):
    """A FIFO data.jsonl was reported 'not found next to the task file'; one opened would wait for a writer."""
    import os

    data = example_evals / "search" / "data.jsonl"
    data.unlink()
    os.mkfifo(data)
    with pytest.raises(QuantgateError) as err:
        load_team(example_evals / "search")
    assert "data.jsonl is a named pipe (FIFO), not a regular file" in str(err.value) and "not found" not in str(
        err.value
    )
    task = next(p for p in (example_evals / "billing").glob("*.yaml") if p.name != "team.yaml")
    task.unlink()
    os.mkfifo(task)
    with pytest.raises(
        QuantgateError, match=f"\n  {task} is a named pipe \\(FIFO\\), not a regular file; give the YAML file$"
    ):
        load_team(example_evals / "billing")


@pytest.mark.parametrize("flag", ["--owner", "--contact"])
@pytest.mark.parametrize("text", ["a\nb", "a\tb", "a\x1b[2Jb"])
def test_new_team_refuses_an_owner_or_contact_of_more_than_one_line(tmp_path, flag, text):
    """--owner $'a\\nb' was written to team.yaml, and validate printed the owner across two lines."""
    from click.testing import CliRunner

    from cli.main import cli

    values = {"--owner": "O", "--contact": "c", flag: text}
    example = {"--owner": "--owner Ranking", "--contact": "--contact ranking-oncall@example.com"}[flag]
    res = CliRunner().invoke(
        cli, ["evals", "new", "ranking", *[x for kv in values.items() for x in kv], "--root", str(tmp_path)]
    )
    assert res.exit_code == 2 and list(tmp_path.iterdir()) == []  # a usage error, as every bad argument
    assert res.output.splitlines()[-1] == (
        f"Error: Invalid value for '{flag}': must be one line of printable characters (it is written to team.yaml "
        f"and printed by validate), e.g. {example}"
    )


@pytest.mark.parametrize("flag", ["--owner", "--contact"])
def test_new_team_bounds_the_owner_and_contact_as_by_is(tmp_path, flag):
    """A 100,000-character --owner was written to team.yaml (and printed by validate); --by, the other name
    quantgate keeps, is bounded at 250."""
    from click.testing import CliRunner

    from cli.main import cli
    from quantgate.teams import MAX_PERSON
    from registry.approval import MAX_NAME

    assert MAX_PERSON == MAX_NAME == 250
    example = {"--owner": "--owner Ranking", "--contact": "--contact ranking-oncall@example.com"}[flag]
    for text in ("x" * 251, "x" * 100_000):
        values = {"--owner": "O", "--contact": "c", flag: text}
        res = CliRunner().invoke(
            cli, ["evals", "new", "ranking", *[x for kv in values.items() for x in kv], "--root", str(tmp_path)]
        )
        assert res.exit_code == 2 and list(tmp_path.iterdir()) == [], res.output
        assert res.output.splitlines()[-1] == (
            f"Error: Invalid value for '{flag}': {len(text)} characters; at most 250 (it is written to team.yaml and "
            f"printed by validate): give a team's name or an address, e.g. {example}"
        )


@pytest.mark.parametrize("key", ["owner", "contact"])
def test_an_owner_or_contact_over_the_bound_in_team_yaml_is_refused_at_its_line(example_evals, key):
    """validate read a team.yaml owner of any length (one `evals new` now refuses)."""
    policy = example_evals / "support" / "team.yaml"
    set_policy_field(policy, key, "x" * 250)
    assert getattr(load_team(example_evals / "support").policy, key) == "x" * 250  # the bound itself is fine
    set_policy_field(policy, key, "x" * 251)
    line = next(n for n, ln in enumerate(policy.read_text().splitlines(), 1) if ln.startswith(f"{key}:"))
    with pytest.raises(QuantgateError) as err:
        load_teams(example_evals)
    assert f"{policy}:{line}: {key}: is 251 characters; at most 250: give a team's name or an address" in str(err.value)


def set_policy_field(policy: Path, key: str, yaml_value: str) -> None:
    """Rewrite the `key:` line of a team.yaml to `key: yaml_value` (written as given: YAML escapes stay)."""
    lines = [f"{key}: {yaml_value}" if ln.startswith(f"{key}:") else ln for ln in policy.read_text().splitlines()]
    policy.write_text("\n".join(lines) + "\n")


def test_an_owner_of_two_lines_in_team_yaml_is_refused(example_evals):
    set_policy_field(example_evals / "support" / "team.yaml", "owner", '"ML\\nsupport"')
    with pytest.raises(QuantgateError, match=r"team.yaml:\d+: owner: must be one line of printable characters"):
        load_teams(example_evals)


@pytest.mark.parametrize(
    "given, said",
    [
        (
            [],
            "--owner was not given and stdin ended before it could be asked for; give --owner and --contact on the "
            "command line, e.g. --owner Ranking --contact ranking-oncall@example.com",
        ),
        (
            ["--owner", "O"],
            "--contact was not given and stdin ended before it could be asked for; give --contact on "
            "the command line, e.g. --contact ranking-oncall@example.com",
        ),
    ],
)
def test_new_team_without_input_to_ask_on_says_which_options_to_give(tmp_path, given, said):
    """`evals new TEAM </dev/null` printed `Owner: Aborted!`."""
    from click.testing import CliRunner

    from cli.main import cli

    res = CliRunner().invoke(cli, ["evals", "new", "ranking", *given, "--root", str(tmp_path)], input="")
    assert res.exit_code == 2 and res.output.endswith(f"\nError: {said}\n") and "Aborted" not in res.output
    assert list(tmp_path.iterdir()) == []
    asked = CliRunner().invoke(cli, ["evals", "new", "ranking", "--root", str(tmp_path)], input=" \nRanking\nr@x\n")
    assert asked.exit_code == 0 and load_team(tmp_path / "ranking").policy.contact == "r@x"  # a terminal still asks
    # a blank answer is asked again (click names no option at its prompt)
    assert "Owner:  \nError: it is blank; say whom the gate reports to, e.g. --owner Ranking\nOwner: " in asked.output
    assert load_team(tmp_path / "ranking").policy.owner == "Ranking"


@pytest.mark.parametrize(
    "args, name",
    [(["new", "ranking", "--owner", "O", "--contact", "c", "--root", ""], "--root"), (["validate", ""], "[PATH]")],
)
def test_an_empty_path_is_refused_naming_it_not_taken_as_the_current_folder(tmp_path, monkeypatch, args, name):
    """`--root ''` wrote the team folder into the working directory; `evals validate ''` validated it."""
    from click.testing import CliRunner

    from cli.main import cli

    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["evals", *args])
    assert res.exit_code == 2 and list(tmp_path.iterdir()) == []
    assert res.output.splitlines()[-1] == f"Error: Invalid value for '{name}': the path is empty; give a file or folder"


def test_a_team_folder_without_its_policy_is_an_error_not_a_missing_team(example_evals):
    (example_evals / "search" / "team.yaml").unlink()
    with pytest.raises(
        QuantgateError, match=r"team search: 1 problem\(s\):\n  .*search: has task or data files but no team.yaml"
    ):
        load_teams(example_evals)


def test_a_task_or_data_file_beside_the_team_folders_is_an_error_not_a_silent_pass(example_evals):
    """A task YAML or data file put in evals/ itself, not in a team's folder, was read by no team and validate said
    ok: the set it meant to gate dropped out without a word. Shared (_) and hidden (.) files stay ignored."""
    shutil.copyfile(example_evals / "search" / "capitals.yaml", example_evals / "ranking.yaml")
    shutil.copyfile(example_evals / "search" / "data.jsonl", example_evals / "data.jsonl")
    (example_evals / "_shared.yaml").write_text("output_type: multiple_choice\n")
    (example_evals / ".backup.yaml").write_text("x: [\n")
    with pytest.raises(QuantgateError) as err:
        load_teams(example_evals)
    lines = str(err.value).splitlines()
    assert lines == [
        f"{example_evals / name}: a task or data file beside the team folders is read by no team; move it into its "
        f"team's folder ({example_evals / '<team>'}, with a team.yaml) or out of the eval sets"
        for name in ("data.jsonl", "ranking.yaml")
    ]
    assert load_team(example_evals / "search").name == "search"  # one team's folder: its own files only
    (example_evals / "ranking.yaml").unlink()
    (example_evals / "data.jsonl").unlink()
    assert len(load_teams(example_evals)) == 3


def test_one_team_folder_or_a_missing_one_given_for_the_eval_sets_is_named_as_such(example_evals, tmp_path):
    """`quantgate canary load --evals evals/search` said "evals/search: no team folders (a folder with team.yaml)"
    of a folder with a team.yaml; a missing folder read as "not a folder of team eval sets"."""
    search = example_evals / "search"
    with pytest.raises(QuantgateError) as err:
        load_teams(search)
    assert str(err.value) == (
        f"{search}: one team's folder (it has team.yaml); give the folder that holds the team folders, {example_evals}"
    )
    with pytest.raises(QuantgateError, match=r"^\S*/none: does not exist; give the folder of team eval sets"):
        load_teams(tmp_path / "none")
    with pytest.raises(QuantgateError, match=r"^\S*/team.yaml: not a folder; give the folder of team eval sets"):
        load_teams(search / "team.yaml")


def test_a_team_written_with_yml_files_is_named_not_dropped(example_evals):
    """billing's files renamed to .yml: validate passed and listed only search and support, so billing was not
    gated and nothing said so."""
    billing = example_evals / "billing"
    (billing / "team.yaml").rename(billing / "team.yml")
    (billing / "arithmetic.yaml").rename(billing / "arithmetic.yml")
    with pytest.raises(
        QuantgateError, match=r"team billing: 1 problem\(s\):\n  .*billing/team.yml: the policy file is team.yaml"
    ):
        load_teams(example_evals)
    (billing / "team.yml").rename(billing / "team.yaml")
    with pytest.raises(
        QuantgateError, match=r"billing/arithmetic.yml: task files end in .yaml, .* rename it arithmetic.yaml"
    ):
        load_teams(example_evals)
    with pytest.raises(QuantgateError, match=r"arithmetic.yml: task files end in .yaml"):
        load_teams(example_evals, only="billing")
    (billing / "team.yaml").rename(billing / "team.yml")
    with pytest.raises(QuantgateError, match=r"^\S*billing/team.yml: the policy file is team.yaml"):
        load_teams(billing)  # `quantgate evals validate evals/billing`: not "no team folders"
    for team in ("search", "support"):  # every team written so: each named, not "no team folders"
        (example_evals / team / "team.yaml").rename(example_evals / team / "team.yml")
    with pytest.raises(QuantgateError) as err:
        load_teams(example_evals)
    named = [line.strip().split(": ")[0] for line in str(err.value).splitlines() if line.startswith("  ")]
    assert named == [str(example_evals / team / "team.yml") for team in ("billing", "search", "support")]
    (billing / "arithmetic.yml").rename(billing / "arithmetic.yaml")
    (billing / "team.yaml").write_text((billing / "team.yml").read_text())
    with pytest.raises(QuantgateError, match=r"billing/team.yml: a second policy file beside team.yaml; delete"):
        load_teams(example_evals, only="billing")


def test_a_folder_with_only_data_or_a_policy_that_is_a_folder_is_named(example_evals):
    support = example_evals / "support"
    for p in support.glob("*.yaml"):
        p.unlink()
    with pytest.raises(QuantgateError, match=r"support: has task or data files but no team.yaml"):
        load_teams(example_evals)
    (support / "team.yaml").mkdir()
    with pytest.raises(QuantgateError, match=r"support/team.yaml: not a file"):
        load_teams(example_evals)
    with pytest.raises(QuantgateError, match=r"support/team.yaml: not a file"):
        load_teams(example_evals, only="support")
    shutil.rmtree(support)
    (example_evals / "_shared").mkdir()
    (example_evals / "_shared" / "x.yaml").write_text("a: 1\n")  # shared templates: not a team, not an error
    assert [t.name for t in load_teams(example_evals)] == ["billing", "search"]


def test_a_data_file_that_is_a_folder_is_named_as_a_folder(example_evals):
    data = example_evals / "billing" / "data.jsonl"
    data.unlink()
    data.mkdir()
    with pytest.raises(QuantgateError, match=r"arithmetic.yaml:\d+: .*data.jsonl is a folder; name the JSONL file"):
        load_teams(example_evals)


def test_report_of_a_folder_says_it_is_a_folder(tmp_path):
    from click.testing import CliRunner

    from cli.main import cli

    res = CliRunner().invoke(cli, ["report", "--gate-json", str(tmp_path)])
    assert res.exit_code == 1 and f"{tmp_path} is a folder; give the gate's JSON file" in res.output, res.output
    res = CliRunner().invoke(cli, ["report", "--gate-json", str(tmp_path / "gate.json")])
    assert res.exit_code == 1 and "gate.json not found: run `dvc repro` first" in res.output, res.output


@pytest.mark.parametrize("args, flag", [(["report", "--gate-json"], "--gate-json")])
def test_an_input_file_that_is_a_fifo_is_named_not_read_or_called_missing(tmp_path, monkeypatch, args, flag):
    """`report --gate-json FIFO` said "not found". (`canary run --token-file FIFO`, which waited forever reading it,
    is checked when read: test_canary_gateway.py test_a_token_file_is_checked_only_when_it_is_read.)"""
    from click.testing import CliRunner

    from cli.main import cli

    monkeypatch.delenv("QUANTGATE_ADMIN_TOKEN", raising=False)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    res = CliRunner().invoke(cli, [*args, str(fifo)])
    assert res.exit_code == 2, res.output
    assert res.output.splitlines()[-1] == (
        f"Error: Invalid value for '{flag}': {fifo} is a named pipe (FIFO), not a regular file; give the file itself"
    )
    (tmp_path / "to_fifo").symlink_to("fifo")  # named with its target, as --token-file's is (files.not_to_open)
    res = CliRunner().invoke(cli, [*args, str(tmp_path / "to_fifo")])
    assert res.exit_code == 2 and res.output.splitlines()[-1] == (
        f"Error: Invalid value for '{flag}': {tmp_path}/to_fifo is a symlink to a named pipe (FIFO) at fifo, not a "
        "regular file; give the file itself"
    ), res.output
    (tmp_path / "link").symlink_to(tmp_path / "gone.json")  # DVC's outs may be links into its cache
    (tmp_path / "loop").symlink_to("loop")  # was "a broken symlink (to loop); restore its target"
    (tmp_path / "file").write_text("{}")
    (tmp_path / "through").symlink_to("file/x")  # ENOTDIR: was called a loop by evals new
    for name, what in [
        ("link", f"a broken symlink: its target {tmp_path}/gone.json does not exist"),
        ("loop", "a symlink loop: its target loop leads back to it"),
        ("through", "a broken symlink: its target file/x does not exist"),
    ]:
        res = CliRunner().invoke(cli, [*args, str(tmp_path / name)])
        assert res.exit_code == 2 and res.output.splitlines()[-1] == (
            f"Error: Invalid value for '{flag}': {tmp_path}/{name} is {what}; fix the link or give the file itself"
        ), res.output
    res = CliRunner().invoke(cli, [*args, ""])
    assert res.exit_code == 2 and res.output.splitlines()[-1] == (
        f"Error: Invalid value for '{flag}': the path is empty; give a file"
    )


@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_new_team_over_a_file_says_what_is_there(tmp_path, kind):
    """`evals new afile` said "already exists; pick another name or edit that folder": there was no folder."""
    from quantgate.scaffold import new_team

    where = tmp_path / "ranking"
    where.write_text("x") if kind == "file" else os.mkfifo(where)
    what = "a file" if kind == "file" else "a named pipe (FIFO)"
    with pytest.raises(QuantgateError) as err:
        new_team(tmp_path, "ranking", "Owner", "c@example.com")
    assert str(err.value) == (f"{where} already exists and is {what}, not a team folder; pick another name or move it")


def test_hidden_yaml_files_are_not_tasks(example_evals):
    """macOS copies a folder with `._<name>` resource forks (binary, not YAML); editors leave `.name.yaml` backups."""
    (example_evals / "billing" / "._arithmetic.yaml").write_bytes(b"\x00\x05\x16\x07Mac OS X        \x00\x02")
    (example_evals / "billing" / ".arithmetic.yaml").write_text("task: [unclosed\n")
    billing = next(t for t in load_teams(example_evals) if t.name == "billing")
    assert [t.path.name for t in billing.tasks] == ["arithmetic.yaml"]


def test_repeats_lm_eval_never_scores_are_accepted(example_evals):
    # a few-shot example shown twice, and a repeat past team.yaml's limit, are never scored: nothing counts twice
    shots = example_evals / "support" / "fewshot.jsonl"
    shots.write_text(shots.read_text() + shots.read_text().splitlines()[0] + "\n")
    data = example_evals / "billing" / "data.jsonl"
    first = json.loads(data.read_text().splitlines()[0])
    data.write_text(data.read_text() + json.dumps({**first, "id": "again"}) + "\n")
    with pytest.raises(QuantgateError, match=r"data.jsonl:290: renders the same prompt and answer as line 1"):
        load_teams(example_evals)
    policy = example_evals / "billing" / "team.yaml"
    policy.write_text(policy.read_text() + "limit: 200\n")
    assert {t.name: t.tasks[0].n_docs for t in load_teams(example_evals)}["billing"] == 200


def test_a_document_too_long_to_render_is_its_own_problem_not_an_unsafe_template(example_evals):
    """A document whose prompt renders over the sandbox's 1,000,000 characters was reported as `unsafe template`
    (`a template may use the document's fields, filters and tests only`) at the task's line, and the template was
    then not checked on the other documents."""
    data = example_evals / "search" / "data.jsonl"
    long = {"question": "x" * 1_000_001, "choices": ["a", "b"], "answer": 0}
    again = {**long, "question": "y" * 1_000_001}
    data.write_text(data.read_text() + json.dumps(long) + "\n" + json.dumps(again) + "\n")
    with pytest.raises(QuantgateError) as err:
        load_teams(example_evals)
    message = str(err.value)
    assert "team search: 2 problem(s)" in message and "unsafe template" not in message
    for line in (217, 218):
        assert (
            f"data.jsonl:{line}: doc_to_text: `Question: {{{{question}}}} Answer:` cannot be rendered for this "
            "document: it renders 1,000,019 characters, over the 1,000,000 a rendered text may have; shorten the "
            "document's fields or the template"
        ) in message


def test_a_second_task_scores_the_same_documents_only_with_other_settings(example_evals):
    """The gate pools a team's tasks in one paired test: a copy of a task (the same file, or a copy of it) counted
    every document twice and passed validation. A second task that prompts otherwise, or scores fewer documents by
    the team's limit, is a measurement of its own."""
    search = example_evals / "search"
    task = (search / "capitals.yaml").read_text()
    shutil.copyfile(search / "data.jsonl", search / "copy.jsonl")
    (search / "capitals_again.yaml").write_text(
        task.replace("task: search_capitals", "task: search_again").replace("test: data.jsonl", "test: copy.jsonl")
    )
    with pytest.raises(QuantgateError) as err:
        load_teams(example_evals)
    assert f"{search / 'copy.jsonl'}:1: renders in task 'search_again' the same prompt and answer" in str(err.value)
    assert f"as {search / 'data.jsonl'}:1 in task 'search_capitals'" in str(err.value)
    assert "team search: 216 problem(s)" in str(err.value)
    (search / "capitals_again.yaml").write_text(
        task.replace("task: search_capitals", "task: search_again").replace("Question: ", "Q: ")
    )
    search_team = next(t for t in load_teams(example_evals) if t.name == "search")
    assert [t.n_docs for t in search_team.tasks] == [216, 216]


def test_a_copied_task_with_its_few_shot_file_copied_or_a_metric_added_still_repeats(example_evals):
    """The repeat rule compared few-shot files by path and every metric_list entry: a copy of a task whose few-shot
    file was copied under another name, or which added a metric the gate never reads, scored each document as the
    first task does, counted twice in the paired test, and passed. Another num_fewshot is a measurement of its own."""
    support = example_evals / "support"
    task = (support / "sentiment.yaml").read_text().replace("task: support_sentiment", "task: support_again")
    shutil.copyfile(support / "fewshot.jsonl", support / "shots_copy.jsonl")
    added = "metric_list:\n  - metric: brier_score\n    aggregation: brier_score\n    higher_is_better: false\n"
    for copy in (
        task.replace("train: fewshot.jsonl", "train: shots_copy.jsonl"),
        task.replace("metric_list:\n", added),
    ):
        assert copy != task
        (support / "again.yaml").write_text(copy)
        with pytest.raises(
            QuantgateError, match=r"(?s)^team support: 304 .*in task 'support_sentiment' the same prompt"
        ):
            load_teams(example_evals)
    (support / "again.yaml").write_text(task.replace("num_fewshot: 4", "num_fewshot: 2"))
    team = next(t for t in load_teams(example_evals) if t.name == "support")
    assert [t.name for t in team.tasks] == ["support_again", "support_sentiment"]


def test_a_contact_of_invisible_characters_is_blank(example_evals):
    set_policy_field(example_evals / "support" / "team.yaml", "contact", '"\\u00a0\\u200b"')
    with pytest.raises(QuantgateError, match=r"team.yaml:\d+: contact: is blank; name who owns the set"):
        load_teams(example_evals)


def test_a_team_name_ending_in_a_newline_is_refused(tmp_path):
    """`$` matches before a trailing newline: `evals new $'nl\\n'` wrote files it then called invalid YAML, and a
    folder 'ranking\\n' passed validate."""
    from quantgate.scaffold import new_team
    from quantgate.teams import inspect_team

    with pytest.raises(QuantgateError, match=r"team name 'nl\\n': use lower_snake_case"):
        new_team(tmp_path, "nl\n", "o", "c@example.com")
    assert list(tmp_path.iterdir()) == []
    shutil.copytree(REPO / "evals" / "search", tmp_path / "search\n")
    team, problems = inspect_team(tmp_path / "search\n")
    assert any("team folder name 'search\\n': use lower_snake_case" in p for p in problems), problems


@pytest.mark.parametrize("owner", ["x🚀", "排名", 'Zoë O\'Brien "ZO"'])
def test_an_owner_beyond_ascii_is_written_as_given(tmp_path, owner):
    """An emoji owner failed `evals new` ("unable to parse raw data as a unicode string"): JSON's surrogate pair
    was read by YAML as two lone surrogates; others were written as escapes ("\\u6392\\u540d")."""
    from quantgate.scaffold import new_team

    team = new_team(tmp_path, "unicode_team", owner, "c@example.com")
    text = (tmp_path / "unicode_team" / "team.yaml").read_text(encoding="utf-8")
    assert f"owner: {json.dumps(owner, ensure_ascii=False)}" in text and "\\u" not in text
    assert team.policy.owner == owner


def test_new_team_over_a_broken_symlink_names_the_link_and_its_target(tmp_path):
    """`evals new ranking` where evals/ranking is a link to nothing said only "cannot create ...: Not a directory"."""
    from click.testing import CliRunner

    from cli.main import cli

    (tmp_path / "ranking").symlink_to(tmp_path / "gone")
    res = CliRunner().invoke(
        cli, ["evals", "new", "ranking", "--owner", "O", "--contact", "c", "--root", str(tmp_path)]
    )
    assert res.exit_code == 1 and "Not a directory" not in res.output
    assert res.output == (
        f"Error: {tmp_path / 'ranking'} is a broken symlink: its target {tmp_path / 'gone'} does not exist; remove "
        "the link (a team folder is written in place, never through a symlink) or pick another name\n"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["ranking"] and (tmp_path / "ranking").is_symlink()


@pytest.mark.parametrize(
    "target, what",
    [
        ("ranking", "a symlink loop: its target ranking leads back to it"),
        # a folder on the way that is a file (ENOTDIR) was "a symlink loop: its target notes.txt/x leads back to it"
        ("notes.txt/x", "a broken symlink: its target notes.txt/x does not exist"),
    ],
)
def test_new_team_over_a_symlink_loop_says_it_is_a_loop(tmp_path, target, what):
    """A link to itself was "a broken symlink: its target ranking does not exist", which it does: it is the link."""
    from click.testing import CliRunner

    from cli.main import cli

    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "ranking").symlink_to(target)
    res = CliRunner().invoke(
        cli, ["evals", "new", "ranking", "--owner", "O", "--contact", "c", "--root", str(tmp_path)]
    )
    assert res.exit_code == 1 and res.output == (
        f"Error: {tmp_path / 'ranking'} is {what}; remove the link (a team folder is written in place, never through "
        "a symlink) or pick another name\n"
    )


@pytest.mark.parametrize(
    "make, what",
    [
        (lambda p: p.write_text("x"), "a symlink to a file at notes.txt"),
        (os.mkfifo, "a symlink to a named pipe (FIFO) at notes.txt"),
    ],
    ids=["file", "fifo"],
)
def test_new_team_over_a_symlink_to_a_file_names_the_link_and_its_target(tmp_path, make, what):
    """A link to a file was "already exists and is a file": the team folder's name is a link, which it did not say."""
    from click.testing import CliRunner

    from cli.main import cli

    make(tmp_path / "notes.txt")
    (tmp_path / "ranking").symlink_to("notes.txt")
    res = CliRunner().invoke(
        cli, ["evals", "new", "ranking", "--owner", "O", "--contact", "c", "--root", str(tmp_path)]
    )
    assert res.exit_code == 1 and res.output == (
        f"Error: {tmp_path / 'ranking'} already exists and is {what}, not a team folder; pick another name or move it\n"
    )
    assert (tmp_path / "ranking").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "ranking"]


def test_new_team_whose_task_name_is_taken_says_so_before_writing(example_evals):
    """The clash was found after the scaffold was written and removed, and its advice ("rename one") named the
    removed ranking.yaml."""
    from quantgate.scaffold import new_team

    capitals = example_evals / "search" / "capitals.yaml"
    capitals.write_text(capitals.read_text().replace("task: search_capitals", "task: ranking_example"))
    before = sorted(p.name for p in example_evals.iterdir())
    with pytest.raises(QuantgateError) as err:
        new_team(example_evals, "ranking", "O", "c@example.com")
    assert str(err.value) == (
        f"task name 'ranking_example', the one `evals new ranking` writes, is already used by {capitals}; pick "
        "another team name (nothing was written)"
    )
    assert sorted(p.name for p in example_evals.iterdir()) == before
    assert new_team(example_evals, "ranked", "O", "c@example.com").tasks[0].name == "ranked_example"


def test_an_owner_with_a_no_break_space_is_read_with_a_plain_space(example_evals, tmp_path):
    """`owner: "Search\\u00a0Relevance"` was refused as "must be one line of printable characters"; an owner is
    display text (validate's report, results/teams.json), so the space is made a plain one, as `evals new` writes."""
    from click.testing import CliRunner

    from cli.main import cli

    set_policy_field(example_evals / "search" / "team.yaml", "owner", '"Search\\u00a0Relevance\\u202f(EU)"')
    assert load_team(example_evals / "search").policy.owner == "Search Relevance (EU)"
    res = CliRunner().invoke(
        cli, ["evals", "new", "ranking", "--owner", "Rank\u00a0ing", "--contact", "c", "--root", str(tmp_path)]
    )
    assert res.exit_code == 0, res.output
    assert 'owner: "Rank ing"\n' in (tmp_path / "ranking" / "team.yaml").read_text(encoding="utf-8")
    assert load_team(tmp_path / "ranking").policy.owner == "Rank ing"
    set_policy_field(example_evals / "search" / "team.yaml", "owner", '"Search\\u2028Relevance"')  # a line break
    with pytest.raises(QuantgateError, match=r"team.yaml:\d+: owner: must be one line of printable characters"):
        load_team(example_evals / "search")


def test_a_symlinked_team_folder_is_refused_as_its_files_would_be(example_evals, tmp_path):
    """evals/linked -> elsewhere validated as team `linked`, while its symlinked files are refused: git keeps the
    link, not the files, so a fresh clone would have no such team (or a broken link)."""
    shutil.copytree(example_evals / "search", tmp_path / "elsewhere")
    for f in (tmp_path / "elsewhere").glob("*.yaml"):  # its own task names: not a clash with search's
        f.write_text(f.read_text().replace("task: ", "task: linked_"))
    (example_evals / "linked").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(QuantgateError) as err:
        load_teams(example_evals)
    assert str(err.value).splitlines()[1:] == [
        f"  {example_evals / 'linked'}: is a symlink (to {tmp_path / 'elsewhere'}); a team folder must be a folder "
        "itself, committed with its files (git keeps a link, not what it points to): copy it in"
    ], str(err.value)


def test_yaml_files_named_in_another_case_are_named_not_skipped(example_evals):
    """billing/arithmetic.YAML and evals/x.YAML were neither read (lm-eval reads *.yaml alone) nor reported: billing
    had no task read, and the stray file dropped out without a word."""
    billing = example_evals / "billing"
    (billing / "arithmetic.yaml").rename(billing / "arithmetic.YAML")
    with pytest.raises(QuantgateError) as err:
        load_teams(example_evals)
    assert (
        f"{billing / 'arithmetic.YAML'}: task files end in .yaml, and this one would not be scored; rename it "
        "arithmetic.yaml" in str(err.value)
    )
    (billing / "arithmetic.YAML").rename(billing / "arithmetic.yaml")
    (example_evals / "x.YAML").write_text("task: x\n")
    with pytest.raises(QuantgateError) as err:
        load_teams(example_evals)
    assert f"{example_evals / 'x.YAML'}: a task or data file beside the team folders is read by no team" in str(
        err.value
    )


def test_a_task_without_a_scored_split_is_named_beside_another_task(example_evals):
    """A task YAML without test_split ended `evals validate` with a KeyError traceback (the rule that no two tasks
    score one document looked up the scored split's file)."""
    capitals = example_evals / "search" / "capitals.yaml"
    capitals.write_text(capitals.read_text().replace("test_split: test\n", ""))
    with pytest.raises(QuantgateError, match=r"capitals.yaml:\d+: no test_split \(nor validation_split\)"):
        load_teams(example_evals)


def test_validate_and_canary_load_refuse_a_folder_that_is_not_one_as_a_bad_argument(tmp_path, monkeypatch):
    """`evals validate /missing` and `canary load --evals /missing` exited 1, an error, where the README's
    convention gives 2 for a bad argument (as `evals new --root` did already)."""
    from click.testing import CliRunner

    from cli.main import cli

    (tmp_path / "a-file").write_text("")
    monkeypatch.chdir(tmp_path)  # no evals/ here: the default is missing too
    load = ["canary", "load", "--url", "http://127.0.0.1:9", "--rps", "1", "--duration", "1"]
    for args, said in (
        (["evals", "validate", "none"], "Invalid value for '[PATH]': none does not exist; give the folder of team"),
        (["evals", "validate", "a-file"], "'[PATH]': a-file is not a folder; give the folder of team eval sets"),
        (["evals", "validate"], "evals does not exist (the default: run this in the project folder, or give PATH)"),
        ([*load, "--evals", "none"], "Invalid value for '--evals': none does not exist; give the folder of team"),
        (load, "evals does not exist (the default: run this in the project folder, or give --evals); give the"),
    ):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2 and said in result.output.splitlines()[-1], (args, result.output)


def test_a_folder_of_eval_sets_that_is_a_dangling_link_or_cannot_be_looked_up_is_a_bad_argument(tmp_path, monkeypatch):
    """quantgate.options.Folder said a symlink to nothing "does not exist" (the link does), and a name too long
    for the system (ENAMETOOLONG, which pathlib's is_dir raises) was OSError's traceback, exit 1."""
    from click.testing import CliRunner

    from cli.main import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken").symlink_to("nowhere")
    (tmp_path / "loop").symlink_to("loop")
    load = ["canary", "load", "--url", "http://127.0.0.1:9", "--rps", "1", "--duration", "1", "--evals"]
    for args, said in (
        (["evals", "validate", "broken"], "broken is a broken symlink: its target nowhere does not exist; fix the"),
        ([*load, "loop"], "'--evals': loop is a symlink loop: its target loop leads back to it; fix the link or give"),
        (["evals", "validate", "x" * 300], f"{'x' * 300} cannot be looked up (File name too long); give the folder"),
        ([*load, "x" * 300], "cannot be looked up (File name too long); give the folder of team eval sets"),
    ):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2 and said in result.output.splitlines()[-1], (args, result.output)


def test_canary_run_refuses_its_default_evals_folder_missing_as_canary_load_does(tmp_path, monkeypatch):
    """`canary run --load-rps 1` without --evals, outside the project: exit 1 naming --evals, which was not given,
    where `canary load` says the default is missing as a bad argument (exit 2); without --load-rps no evals is read."""
    from click.testing import CliRunner

    from cli.main import cli

    monkeypatch.chdir(tmp_path)  # no evals/, no params.yaml, no registry
    run = ["canary", "run", "m", "2", "--by", "t"]
    result = CliRunner().invoke(cli, [*run, "--load-rps", "1"])
    assert result.exit_code == 2 and result.output.splitlines()[-1] == (
        "Error: Invalid value for '--evals': evals does not exist (the default: run this in the project folder, or "
        "give --evals); give the folder of team eval sets (evals/); see evals/README.md"
    ), result.output
    result = CliRunner().invoke(cli, run)
    assert result.exit_code == 1 and "evals" not in result.output, result.output
