"""A team's calibration.jsonl, checked by one kernel function in the validate stage (and the calibrate stage):
the exact one-line error for each kind of bad line, and a good file that passes."""

import json
import sys

import pytest

from pipeline import validate
from quantgate.calibration import TEAM_FILE, eval_strings, team_conversations
from quantgate.errors import QuantgateError
from quantgate.teams import load_teams
from tests.conftest import REPO

# the line a team is told to write, as the messages say it (written out, not quantgate.calibration.SHAPE: a test
# reading the module's own string would pass whatever that string became)
SHAPE = '{"messages": [{"role": "user"|"assistant"|"system", "content": "..."}, ...]}'

GOOD = {"messages": [{"role": "user", "content": "Where is my parcel?"}, {"role": "assistant", "content": "Hi!"}]}


def run_validate(evals, tmp_path, monkeypatch):
    """The validate stage as dvc.yaml runs it (params.yaml of the repo), in-process."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["validate", str(evals), str(tmp_path / "teams.json")])
    validate.main()


def first_line(evals, team: str, field: str) -> str:
    return json.loads((evals / team / "data.jsonl").read_text().splitlines()[0])[field]


@pytest.mark.parametrize(
    "line, error",
    [
        (
            b"{'messages': []}",
            "invalid JSON (Expecting property name enclosed in double quotes at column 2); write each line as one "
            f"JSON object, {SHAPE}",
        ),
        (b'{"messages": "caf\xe9"}', "not UTF-8 (byte 0xe9); save the file as UTF-8"),
        # each line's own cause and fix: not "save it as UTF-8", nor the datasets loader, which never reads this file
        (
            b'{"messages": [{"role": "user", "content": "a", "content": "b"}]}',
            "key 'content' is given twice in one object; keep one",
        ),
        (
            b'{"messages": [{"role": "user", "content": NaN}]}',
            "NaN is not JSON (RFC 8259 has no NaN or Infinity; quantgate's no-NaN rule); write a number, a string "
            "or null",
        ),
        (b'{"messages": "hi"}', "expected " + SHAPE),
        (b'{"messages": []}', "expected " + SHAPE),
        (b'{"messages": [{"role": "bot", "content": "hi"}]}', "expected " + SHAPE),
        (b'{"messages": [{"role": "user"}]}', "expected " + SHAPE),
        (b'[{"role": "user", "content": "hi"}]', "expected " + SHAPE),
    ],
)
def test_validate_stage_refuses_a_bad_line_naming_file_line_and_fix(example_evals, tmp_path, monkeypatch, line, error):
    path = example_evals / "support" / TEAM_FILE
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + line + b"\n")
    with pytest.raises(QuantgateError) as err:
        run_validate(example_evals, tmp_path, monkeypatch)
    assert str(err.value) == f"{path}:2: {error}"
    assert not (tmp_path / "teams.json").exists()


def test_validate_stage_refuses_a_conversation_quoting_the_teams_eval_document(example_evals, tmp_path, monkeypatch):
    message = first_line(example_evals, "support", "message")
    path = example_evals / "support" / TEAM_FILE
    leak = {"messages": [{"role": "user", "content": f"Classify:  {message.upper()}"}]}
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(leak) + "\n")
    with pytest.raises(QuantgateError) as err:
        run_validate(example_evals, tmp_path, monkeypatch)
    data = (example_evals / "support" / "data.jsonl").resolve()
    assert str(err.value) == (
        f"{path}:2: this calibration conversation contains the eval document at {data}:1; calibrating on eval "
        "data leaks the test into the build: remove it"
    )


def test_a_conversation_quoting_another_teams_eval_document_is_refused(example_evals):
    teams = load_teams(example_evals)
    question = first_line(example_evals, "search", "question")
    path = example_evals / "support" / TEAM_FILE
    path.write_text(json.dumps({"messages": [{"role": "user", "content": f"Quiz: {question}"}]}) + "\n")
    with pytest.raises(QuantgateError) as err:
        team_conversations(teams)
    data = (example_evals / "search" / "data.jsonl").resolve()
    assert str(err.value) == (
        f"{path}:1: this calibration conversation contains the eval document at {data}:1; calibrating on eval "
        "data leaks the test into the build: remove it"
    )
    billing = example_evals / "billing" / TEAM_FILE  # billing alone: support's file is not read
    assert [where for where, _ in team_conversations(teams[:1])] == [f"{billing}:{i}" for i in range(1, 9)]


def test_a_good_file_validates_and_calibrate_reads_it(example_evals, tmp_path, monkeypatch, capsys):
    path = example_evals / "support" / TEAM_FILE
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(GOOD) + "\n")
    run_validate(example_evals, tmp_path, monkeypatch)
    assert "validate: 18 team calibration conversations: ok" in capsys.readouterr().out  # 8 billing, 8 search
    assert (tmp_path / "teams.json").is_file()
    teams = load_teams(example_evals)
    got = team_conversations(teams, eval_strings(teams))
    assert got == team_conversations(teams)
    # one from each team in turn (billing, search, support), then the teams that have more
    shipped = [example_evals / team / TEAM_FILE for team in ("billing", "search")]
    assert [where for where, _ in got[:6]] == [
        f"{shipped[0]}:1",
        f"{shipped[1]}:1",
        f"{path}:1",
        f"{shipped[0]}:2",
        f"{shipped[1]}:2",
        f"{path}:3",
    ]
    assert [m for where, m in got if where.startswith(str(path))] == [GOOD["messages"]] * 2
    assert len(got) == 8 + 8 + 2


def test_validate_command_checks_the_file_too(example_evals):
    from click.testing import CliRunner

    from cli.main import cli

    path = example_evals / "support" / TEAM_FILE
    path.write_text('{"messages": "hi"}\n')
    res = CliRunner().invoke(cli, ["evals", "validate", str(example_evals / "support")])
    assert res.exit_code == 1 and f"{path}:1: expected {SHAPE}" in res.output, res.output


NO_CONVERSATIONS = (
    "{path}: no conversations (the file is empty, or blank lines only); write one per line, " + SHAPE + ", or delete "
    "the file (calibration.jsonl is optional)"
)


@pytest.mark.parametrize(
    "text, error",
    [
        ("", NO_CONVERSATIONS),
        ("\n  \n", NO_CONVERSATIONS),
        (
            json.dumps(GOOD) + '\n{"messages": [{"role": "assistant", "content": ""}]}\n',
            "{path}:2: this calibration conversation has no text (every content is blank), so it would calibrate on "
            "the chat template alone; write what was said, or remove the line",
        ),
    ],
)
def test_an_empty_file_or_a_conversation_without_text_is_refused(example_evals, text, error):
    """An empty calibration.jsonl passed validate without a word (and without its `ok:` line), and a conversation
    of one empty assistant message was taken as calibration data: the chat template alone."""
    from click.testing import CliRunner

    from cli.main import cli

    path = example_evals / "support" / TEAM_FILE
    path.write_text(text)
    res = CliRunner().invoke(cli, ["evals", "validate", str(example_evals / "support")])
    said = "Error: " + error.replace("{path}", str(path))
    assert res.exit_code == 1 and res.output.splitlines()[-1] == said, res.output
    answered = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": ""}]  # text: fine
    path.write_text(json.dumps({"messages": answered}) + "\n")
    assert [w for w, _ in team_conversations(load_teams(example_evals)) if "support" in w] == [f"{path}:1"]


def test_a_folder_named_calibration_jsonl_is_refused(example_evals, tmp_path, monkeypatch):
    path = example_evals / "support" / TEAM_FILE
    path.unlink()  # the shipped one
    path.mkdir()
    with pytest.raises(QuantgateError) as err:
        run_validate(example_evals, tmp_path, monkeypatch)
    assert str(err.value) == f"{path}: not a file; {TEAM_FILE} is one JSON object per line ({SHAPE})"


def test_eval_data_in_a_json_suffixed_file_is_protected_too(example_evals):
    data = example_evals / "search" / "data.jsonl"
    renamed = data.rename(data.with_suffix(".json"))
    task = example_evals / "search" / "capitals.yaml"
    task.write_text(task.read_text().replace("data.jsonl", "data.json"))
    strings = eval_strings(load_teams(example_evals))
    first = json.loads(renamed.read_text().splitlines()[0])
    long_fields = [v for v in first.values() if isinstance(v, str) and len(v) >= 20]
    assert long_fields and all(" ".join(v.split()).lower() in strings for v in long_fields)


def test_a_symlinked_team_calibration_file_is_refused_as_a_symlink(example_evals, tmp_path):
    outside = tmp_path / "outside.jsonl"
    outside.write_text(json.dumps(GOOD) + "\n")
    (example_evals / "support" / TEAM_FILE).unlink()  # the shipped one
    (example_evals / "support" / TEAM_FILE).symlink_to(outside)
    with pytest.raises(QuantgateError) as err:
        team_conversations(load_teams(example_evals))
    assert str(err.value) == (
        f"{example_evals / 'support' / TEAM_FILE}: a symlink (to {outside}); {TEAM_FILE} must be a regular file in "
        "the team folder: copy it in"
    )


def test_the_example_teams_ship_calibration_text_of_their_kind_and_none_of_their_scored_documents():
    """evals/<team>/calibration.jsonl: each team's own prompt format (its task's doc_to_text), on documents that
    are not scored (every question and message, exactly), with right answers where they can be computed."""
    import re

    def turns(team: str) -> list[tuple[str, str]]:
        rows = [json.loads(line)["messages"] for line in (REPO / "evals" / team / TEAM_FILE).read_text().splitlines()]
        assert len(rows) == 8
        return [(m[i]["content"], m[i + 1]["content"]) for m in rows for i in range(0, len(m), 2)]

    def scored(team: str, field: str) -> set[str]:
        files = [REPO / "evals" / team / name for name in ("data.jsonl", "fewshot.jsonl")]
        return {json.loads(line)[field] for f in files if f.is_file() for line in f.read_text().splitlines()}

    billing = turns("billing")
    for prompt, answer in billing:
        a, op, b = re.fullmatch(r"What is (\d+) ([-+]) (\d+)\? Reply with the number only\.", prompt).groups()
        assert f"What is {a} {op} {b}?" not in scored("billing", "question")
        assert int(answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    questions = scored("search", "question")
    for prompt, answer in turns("search"):
        question = re.fullmatch(r"Question: (Which continent is .+ in\?)\nAnswer:", prompt).group(1)
        assert question not in questions and answer in {
            "Africa",
            "Asia",
            "Europe",
            "North America",
            "South America",
            "Oceania",
        }
    messages = scored("support", "message")
    for prompt, answer in turns("support"):
        message = re.fullmatch(r"Customer message: (.+)\nSentiment:", prompt).group(1)
        assert message not in messages and answer in ("positive", "negative")
    teams = load_teams(REPO / "evals")
    assert len(team_conversations(teams, eval_strings(teams))) == 24


def test_a_short_scored_question_in_a_conversation_is_refused(example_evals):
    """billing's documents are 14-17 characters ("What is 35 - 23?"): under the 20-character rule, but a phrase
    of 4+ words, so a conversation that quotes one is refused; a place name alone ("Paris") is not."""
    teams = load_teams(example_evals)
    path = example_evals / "support" / TEAM_FILE
    question = first_line(example_evals, "billing", "question")
    assert len(question) < 20
    path.write_text(json.dumps({"messages": [{"role": "user", "content": f"Quick one: {question}"}]}) + "\n")
    with pytest.raises(QuantgateError) as err:
        team_conversations(teams)
    data = (example_evals / "billing" / "data.jsonl").resolve()
    assert str(err.value).startswith(f"{path}:1: this calibration conversation contains the eval document at {data}:1;")
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "I loved Paris and Rome."}]}) + "\n")
    assert f"{path}:1" in [where for where, _ in team_conversations(teams)]


def test_one_team_folder_is_checked_against_the_documents_of_the_teams_beside_it(example_evals):
    """`quantgate evals validate evals/<team>` applies the rule the whole-tree check applies: a conversation that
    quotes another team's document is refused; a sibling that does not validate is named, not silently skipped."""
    from click.testing import CliRunner

    from cli.main import cli

    path = example_evals / "billing" / TEAM_FILE
    question = first_line(example_evals, "search", "question")
    with path.open("a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": f"Quiz: {question}"}]}) + "\n")
    result = CliRunner().invoke(cli, ["evals", "validate", str(example_evals / "billing")])
    data = (example_evals / "search" / "data.jsonl").resolve()
    assert result.exit_code == 1 and result.output.splitlines() == [
        f"Error: {path}:9: this calibration conversation contains the eval document at {data}:1; calibrating on "
        "eval data leaks the test into the build: remove it"
    ], result.output
    path.write_text("\n".join(path.read_text().splitlines()[:8]) + "\n")  # the shipped file again
    (example_evals / "search" / "team.yaml").write_text("metric: [\n")  # search no longer validates
    result = CliRunner().invoke(cli, ["evals", "validate", str(example_evals / "billing")])
    assert result.exit_code == 0, result.output
    # the last line names the budget it checked against
    assert result.output.splitlines()[-2].endswith("(not compared with search: they do not validate)")
