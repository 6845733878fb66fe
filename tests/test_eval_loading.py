"""validate accepts exactly what lm-eval will score: each folder here goes through `load_team` and through lm-eval's
own loading (TaskManager(include_path=folder), the data files read relative to the folder, as a team runs lm-eval
on it). Either both accept it and the tasks and documents are the same, or validate refuses it naming file:line."""

import json
from pathlib import Path

import pytest

from quantgate.errors import QuantgateError
from quantgate.teams import load_team
from tests.conftest import REPO


@pytest.fixture(autouse=True)
def datasets_cache_in_tmp(tmp_path, monkeypatch):
    """lm-eval's own loading writes the datasets' Arrow cache: into the test's folder, not ~/.cache."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))


def lm_eval_tasks(folder: Path, monkeypatch) -> dict[str, object]:
    """{task name: lm-eval ConfigurableTask} of a team folder, loaded by lm-eval itself; raises what lm-eval raises."""
    from lm_eval.tasks import TaskManager, get_task_dict

    monkeypatch.chdir(folder)  # data_files are relative to the folder
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    names = sorted(manager.all_subtasks)
    return get_task_dict(names, manager)


def lm_eval_docs(folder: Path, monkeypatch) -> dict[str, list[dict]]:
    """{task name: its scored documents} as lm-eval loads the folder."""
    return {name: list(task.eval_docs) for name, task in lm_eval_tasks(folder, monkeypatch).items()}


def lm_eval_refusal(folder: Path, monkeypatch) -> str:
    """The innermost error lm-eval's own loading of `folder` ends in (the datasets loader wraps its cause)."""
    with pytest.raises(Exception) as err:
        lm_eval_docs(folder, monkeypatch)
    exc = err.value
    while exc.__cause__:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}"


def write_jsonl(path: Path, docs: list[dict], newline: str = "\n", bom: bool = False) -> None:
    text = newline.join(json.dumps(d) for d in docs) + newline
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8"))


def search_docs(example_evals: Path) -> list[dict]:
    return [json.loads(line) for line in (example_evals / "search" / "data.jsonl").read_text().splitlines()]


def refusal(folder: Path) -> str:
    with pytest.raises(QuantgateError) as err:
        load_team(folder)
    return str(err.value)


@pytest.mark.parametrize("team", ["billing", "search", "support"])
def test_shipped_teams_validate_with_the_tasks_and_documents_lm_eval_loads(example_evals, team, monkeypatch):
    validated = load_team(example_evals / team)
    loaded = lm_eval_docs(example_evals / team, monkeypatch)
    assert sorted(loaded) == [t.name for t in validated.tasks]
    for task in validated.tasks:
        assert list(task.docs) == loaded[task.name] and task.n_docs == len(loaded[task.name])
    written = [json.loads(line) for line in (REPO / "evals" / team / "data.jsonl").read_text().splitlines()]
    assert list(validated.tasks[0].docs) == written  # the shipped data read unchanged


def test_a_byte_order_mark_and_crlf_line_ends_are_read_as_the_loader_reads_them(example_evals, monkeypatch):
    docs = search_docs(example_evals)
    write_jsonl(example_evals / "search" / "data.jsonl", docs, newline="\r\n", bom=True)
    validated = load_team(example_evals / "search")
    loaded = lm_eval_docs(example_evals / "search", monkeypatch)["search_capitals"]
    assert list(validated.tasks[0].docs) == docs == loaded


@pytest.mark.parametrize(
    "index, extra, key, column",
    [
        (6, '"answer": 3', "answer", "/answer"),  # the loader refuses the whole file
        (2, '"meta": {"source": "atlas", "source": "wiki"}', "source", "/meta/source"),  # nested
    ],
)
def test_a_key_given_twice_is_refused_at_its_line_as_the_loader_refuses_the_file(
    example_evals, monkeypatch, index, extra, key, column
):
    data = example_evals / "search" / "data.jsonl"
    lines = data.read_text().splitlines()
    lines[index] = lines[index].removesuffix("}") + f", {extra}}}"
    data.write_text("\n".join(lines) + "\n")
    assert f"{data}:{index + 1}: key {key!r} is given twice in one object" in refusal(example_evals / "search")
    assert f"Column({column}) was specified twice" in lm_eval_refusal(example_evals / "search", monkeypatch)


def test_one_float_among_integer_answers_is_refused_at_its_line_only(example_evals, monkeypatch):
    docs = search_docs(example_evals)
    docs[4]["answer"] = 2.0  # one float among integers: the loader makes the whole column float
    write_jsonl(example_evals / "search" / "data.jsonl", docs)
    msg = refusal(example_evals / "search")
    data = example_evals / "search" / "data.jsonl"
    assert "1 problem(s)" in msg  # not one per line of the file: the others give integers
    assert f"{data}:5: answer=2.0 is a float where an integer index into 4 choices (0..3) is expected" in msg
    loaded = lm_eval_docs(example_evals / "search", monkeypatch)["search_capitals"]
    assert loaded[0]["answer"] == docs[0]["answer"] and isinstance(loaded[0]["answer"], float)


def test_a_line_beside_a_float_is_refused_for_its_own_value_as_written(example_evals):
    """An answer of 1.5 on one line and 7 (out of range) on another: the loader reads 7 as 7.0, but the line says
    7, so its problem is the index, not a float it does not have."""
    docs = search_docs(example_evals)
    docs[0]["answer"], docs[6]["answer"] = 1.5, 7
    write_jsonl(example_evals / "search" / "data.jsonl", docs)
    msg = refusal(example_evals / "search")
    data = example_evals / "search" / "data.jsonl"
    assert "2 problem(s)" in msg, msg
    assert f"{data}:1: answer=1.5 is a float where an integer index into 4 choices (0..3) is expected" in msg
    assert f"{data}:7: answer=7 is not an index into 4 choices (0..3)" in msg
    assert "answer=7.0" not in msg


def test_one_float_among_integer_targets_of_a_generated_answer_is_refused(example_evals, monkeypatch):
    """A generate_until set with integer answers and one 28.0 validated: the loader read every answer as a float,
    lm-eval compared the model's "12" with "12.0", and both builds scored 0 (a gate that measured nothing)."""
    data = example_evals / "billing" / "data.jsonl"
    docs = [json.loads(line) for line in data.read_text().splitlines()]
    for doc in docs:
        doc["answer"] = int(doc["answer"])
    load_team(example_evals / "billing")  # integers alone are fine: rendered as "12"
    write_jsonl(data, docs)
    load_team(example_evals / "billing")
    docs[2]["answer"] = float(docs[2]["answer"])
    write_jsonl(data, docs)
    msg = refusal(example_evals / "billing")
    assert "1 problem(s)" in msg, msg
    assert (
        f"{data}:3: answer=28.0 is a float where the other lines give integers: the loader then reads every line's "
        "'answer' as a float, and lm-eval renders and compares 12 as '12.0'; write 28"
    ) in msg
    loaded = lm_eval_docs(example_evals / "billing", monkeypatch)
    assert next(iter(loaded.values()))[0]["answer"] == 12.0  # what lm-eval would have compared


def test_an_integer_beyond_64_bits_among_integer_targets_is_refused_at_its_line(example_evals, monkeypatch):
    """One answer of 10**23 among integers validated: the loader keeps 64-bit integers only, so it read every
    answer as a float and lm-eval compared the model's "12" with "12.0" (a gate that measured nothing)."""
    data = example_evals / "billing" / "data.jsonl"
    docs = [json.loads(line) for line in data.read_text().splitlines()]
    for doc in docs:
        doc["answer"] = int(doc["answer"])
    docs[2]["answer"] = 10**23
    write_jsonl(data, docs)
    msg = refusal(example_evals / "billing")
    assert "1 problem(s)" in msg, msg
    assert (
        f"{data}:3: answer={10**23} is an integer outside the signed 64-bit range where the other lines give "
        f"integers: the loader then reads every line's 'answer' as a float, and lm-eval renders and compares 12 as "
        f"'12.0'; give it as text (\"{10**23}\") or a smaller number"
    ) in msg
    loaded = lm_eval_docs(example_evals / "billing", monkeypatch)
    assert next(iter(loaded.values()))[0]["answer"] == 12.0  # what lm-eval would have compared


def test_an_integer_beyond_64_bits_no_other_line_gives_is_refused_for_what_it_does_to_itself(example_evals):
    """A field only one line gives, as 2**64, was refused 'where the other lines give integers: the loader then reads
    every line's ... as a float', which no other line has: the loader changes this line's own number."""
    data = example_evals / "billing" / "data.jsonl"
    docs = [json.loads(line) for line in data.read_text().splitlines()]
    docs[2]["ticket"] = 2**64
    write_jsonl(data, docs)
    msg = refusal(example_evals / "billing")
    assert "1 problem(s)" in msg and "other lines" not in msg, msg
    assert (
        f"{data}:3: ticket={2**64} is an integer outside the signed 64-bit range (the loader keeps integers from "
        f"-2**63 to 2**63-1): it reads it as the float 1.8446744073709552e+19, and lm-eval renders and compares "
        f'that; give it as text ("{2**64}") or a smaller number'
    ) in msg


def test_an_integer_beyond_64_bits_is_the_one_multiple_choice_line_refused(example_evals):
    """The other lines' integer answers, read as floats because of it, are not blamed for a decimal point."""
    docs = search_docs(example_evals)
    docs[4]["answer"] = 2**63
    write_jsonl(example_evals / "search" / "data.jsonl", docs)
    msg = refusal(example_evals / "search")
    data = example_evals / "search" / "data.jsonl"
    assert "1 problem(s)" in msg and f"{data}:5: answer={2**63} is not an index into 4 choices" in msg, msg
    docs[4]["answer"] = 2**63 - 1  # the largest the loader keeps as an integer: only this line is wrong
    write_jsonl(example_evals / "search" / "data.jsonl", docs)
    assert "1 problem(s)" in refusal(example_evals / "search")


def test_a_nan_answer_is_refused_at_its_line_only(example_evals):
    data = example_evals / "search" / "data.jsonl"
    lines = data.read_text().splitlines()
    doc = json.loads(lines[6])
    lines[6] = json.dumps(doc).replace(f'"answer": {doc["answer"]}', '"answer": NaN')
    data.write_text("\n".join(lines) + "\n")
    msg = refusal(example_evals / "search")
    assert "1 problem(s)" in msg and f"{data}:7: NaN is not JSON" in msg  # the loader reads the rest as floats


def test_a_date_the_loader_turns_into_a_timestamp_is_rendered_as_lm_eval_renders_it(example_evals, monkeypatch):
    from quantgate.templates import lm_eval_value

    docs = search_docs(example_evals)
    for d in docs:
        d["asked"] = "2026-12-03"
    write_jsonl(example_evals / "search" / "data.jsonl", docs)
    task = load_team(example_evals / "search").tasks[0]
    [(name, lm_task)] = lm_eval_tasks(example_evals / "search", monkeypatch).items()
    assert list(task.docs) == list(lm_task.eval_docs)
    config = {**task.config, "doc_to_text": "{{asked}}: {{question}}"}
    rendered = lm_eval_value(config, "doc_to_text", task.docs[0], set(task.docs[0]))
    assert rendered == "2026-12-03 00:00:00: What is the capital of France?"  # a datetime, as lm-eval has it


def test_a_file_only_the_loader_refuses_is_refused_with_its_reason_and_line(example_evals, monkeypatch):
    # fields `type` and `message` (an object, then a string) look to the loader like agent traces it cannot decode
    docs = search_docs(example_evals)
    for i, d in enumerate(docs):
        d.update(type="faq", message={"lang": "en"} if i < 3 else "en")
    write_jsonl(example_evals / "search" / "data.jsonl", docs)
    msg = refusal(example_evals / "search")
    data = example_evals / "search" / "data.jsonl"
    assert f"{data}:4: the datasets JSON loader that lm-eval reads this file with refuses it (ImportError: " in msg
    assert lm_eval_refusal(example_evals / "search", monkeypatch).startswith("ImportError: To support decoding agent")


def test_splits_the_loader_cannot_read_together_are_refused_naming_the_task_line(example_evals, monkeypatch):
    support = example_evals / "support"
    shots = [json.loads(line) for line in (support / "fewshot.jsonl").read_text().splitlines()]
    write_jsonl(support / "fewshot.jsonl", [{**s, "why": "tone"} for s in shots])  # a field data.jsonl lacks
    msg = refusal(support)
    loader = "the datasets JSON loader that lm-eval reads data.jsonl, fewshot.jsonl"
    assert f"{support / 'sentiment.yaml'}:6: {loader}" in msg
    assert "refuses them together (CastError: Couldn't cast" in msg
    assert lm_eval_refusal(support, monkeypatch).startswith("CastError: Couldn't cast")


@pytest.mark.parametrize(
    "line, rule",
    [
        ('{"id": "x", "question": "q?", "choices": ["a", "b"], "answer": NaN}', "no-NaN rule"),
        ('{"id": "x", "question": "q?", "choices": ["a", "b"], "answer": 0}{"id": "y"}', "one-object-per-line rule"),
        ("", "blank-line rule"),
    ],
)
def test_lines_the_loader_reads_but_quantgate_refuses_name_the_rule(example_evals, monkeypatch, line, rule):
    data = example_evals / "search" / "data.jsonl"
    lines = data.read_text().splitlines()
    data.write_text("\n".join(lines[:3] + [line] + lines[3:]) + "\n")
    assert f"{data}:4: " in (msg := refusal(example_evals / "search")) and rule in msg
    lm_eval_docs(example_evals / "search", monkeypatch)  # the loader reads it: the rule is quantgate's own


def test_a_symlinked_data_file_is_called_a_symlink_at_its_task_line(example_evals, tmp_path):
    search = example_evals / "search"
    (tmp_path / "elsewhere.jsonl").write_bytes((search / "data.jsonl").read_bytes())
    (search / "data.jsonl").unlink()
    (search / "data.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    msg = refusal(search)
    assert (
        f"{search / 'capitals.yaml'}:7: dataset_kwargs.data_files.test: data.jsonl is a symlink (to "
        f"{tmp_path / 'elsewhere.jsonl'}); a data file must be a regular file in the team folder"
    ) in msg


def test_a_line_quantgate_refuses_does_not_hide_the_problems_of_the_lines_after_it(example_evals):
    data = example_evals / "support" / "data.jsonl"
    data.write_bytes(
        data.read_bytes() + b'\n{"id": "x", "message": "ok", "label": 7}\n'
    )  # the loader skips a blank line
    msg = refusal(example_evals / "support")
    assert f"{data}:305: blank line" in msg and f"{data}:306: label=7 is not an index into 2 choices (0..1)" in msg


def test_every_data_file_of_a_task_is_checked_when_one_has_no_document(example_evals):
    support = example_evals / "support"
    (support / "data.jsonl").write_text("")
    (support / "fewshot.jsonl").write_text((support / "fewshot.jsonl").read_text() + "\n")
    msg = refusal(support)
    assert f"{support / 'data.jsonl'}: no documents" in msg and f"{support / 'fewshot.jsonl'}:5: blank line" in msg


def test_a_file_the_loader_refuses_is_said_once_with_nothing_of_the_loaders_own_on_stderr(tmp_path):
    # in a process of its own: pytest's logging capture would hide what a user's terminal shows
    import subprocess
    import sys

    data = tmp_path / "data.jsonl"
    data.write_text('{"q": "a", "answer": 0}\n{"q": "b", "answer": 1, "answer": 2}\n')
    code = (
        "from quantgate.loader import LoaderRefused, load_splits\n"
        f"try:\n    load_splits({{'test': {str(data)!r}}})\nexcept LoaderRefused:\n    print('refused')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "refused"
    assert "Failed to load JSON" not in p.stderr and "ArrowInvalid" not in p.stderr, p.stderr


@pytest.mark.parametrize("argv", [["--help"], ["evals/extra"]])
def test_make_example_evals_answers_help_and_refuses_arguments_without_writing(argv, tmp_path):
    # it took no options and ignored them: --help (or a folder meant as its output) rewrote evals/*/data.jsonl
    import shutil
    import subprocess
    import sys

    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "make_example_evals.py", tmp_path / "scripts")
    out = subprocess.run(
        [sys.executable, str(tmp_path / "scripts" / "make_example_evals.py"), *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert not (tmp_path / "evals").exists()
    if argv == ["--help"]:
        assert out.returncode == 0 and "Write the three example team eval sets" in out.stdout
    else:
        assert out.returncode == 2 and "unrecognized arguments: evals/extra" in out.stderr
