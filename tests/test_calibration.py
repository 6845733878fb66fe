"""A team's calibration.jsonl, checked by one kernel function in the validate stage (and the calibrate stage):
the exact one-line error for each kind of bad line, and a good file that passes."""

import json
import sys

import pytest

from pipeline import validate
from quantgate.calibration import SHAPE, TEAM_FILE, eval_strings, team_conversations
from quantgate.errors import QuantgateError
from quantgate.teams import load_teams
from tests.conftest import REPO

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
            "invalid JSON (Expecting property name enclosed in double quotes at column 2); save it as UTF-8, "
            f"one {SHAPE} per line",
        ),
        (b'{"messages": "caf\xe9"}', f"not UTF-8 (byte 0xe9); save it as UTF-8, one {SHAPE} per line"),
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
    assert team_conversations(teams[:1]) == []  # billing alone: support's file is not read


def test_a_good_file_validates_and_calibrate_reads_it(example_evals, tmp_path, monkeypatch, capsys):
    path = example_evals / "support" / TEAM_FILE
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(GOOD) + "\n")
    run_validate(example_evals, tmp_path, monkeypatch)
    assert "validate: 2 team calibration conversations: ok" in capsys.readouterr().out
    assert (tmp_path / "teams.json").is_file()
    teams = load_teams(example_evals)
    expected = [(f"{path}:1", GOOD["messages"]), (f"{path}:3", GOOD["messages"])]
    assert team_conversations(teams, eval_strings(teams)) == team_conversations(teams) == expected


def test_validate_command_checks_the_file_too(example_evals):
    from click.testing import CliRunner

    from cli.main import cli

    path = example_evals / "support" / TEAM_FILE
    path.write_text('{"messages": "hi"}\n')
    res = CliRunner().invoke(cli, ["evals", "validate", str(example_evals / "support")])
    assert res.exit_code == 1 and f"{path}:1: expected {SHAPE}" in res.output, res.output


def test_a_folder_named_calibration_jsonl_is_refused(example_evals, tmp_path, monkeypatch):
    path = example_evals / "support" / TEAM_FILE
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
    (example_evals / "support" / TEAM_FILE).symlink_to(outside)
    with pytest.raises(QuantgateError) as err:
        team_conversations(load_teams(example_evals))
    assert str(err.value) == (
        f"{example_evals / 'support' / TEAM_FILE}: a symlink (to {outside}); {TEAM_FILE} must be a regular file in "
        "the team folder: copy it in"
    )
