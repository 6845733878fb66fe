"""Few-shot examples never come from the scored documents: validate refuses a task whose examples lm-eval would
draw from the documents it scores, naming the task file's setting or the example's line, and lm-eval's own
loading of the same folder shows the leak it prevents."""

import json

import pytest

from quantgate.errors import QuantgateError
from quantgate.teams import load_team
from tests.test_eval_loading import datasets_cache_in_tmp, lm_eval_tasks, search_docs, write_jsonl  # noqa: F401
from tests.test_templates import edit_task


def refusal(folder) -> str:
    with pytest.raises(QuantgateError) as err:
        load_team(folder)
    return str(err.value)


def test_num_fewshot_without_a_fewshot_split_is_refused_as_lm_eval_would_draw_from_the_scored_docs(
    example_evals, monkeypatch
):
    search = example_evals / "search"
    edit_task(search / "capitals.yaml", num_fewshot=3, fewshot_config={"sampler": "first_n"})
    msg = refusal(search)
    assert (
        "num_fewshot: 3 takes its examples from the scored documents (data.jsonl, split 'test', by test_split "
        "(no fewshot_split)): they would be shown with their answers" in msg
    )
    assert f"{search / 'capitals.yaml'}:" in msg.split("num_fewshot: 3")[0].splitlines()[-1]
    [task] = lm_eval_tasks(search, monkeypatch).values()
    assert list(task.fewshot_docs())[:3] == list(task.eval_docs)[:3]  # first_n: the first documents, answers shown


def test_a_fewshot_split_reading_the_scored_file_is_refused_naming_the_setting(example_evals):
    search = example_evals / "search"
    edit_task(
        search / "capitals.yaml",
        num_fewshot=2,
        fewshot_split="train",
        dataset_kwargs={"data_files": {"test": "data.jsonl", "train": "data.jsonl"}},
    )
    msg = refusal(search)
    assert "fewshot_split 'train' reads data.jsonl, the scored file (split 'test')" in msg
    # that line says it once: each of the 216 examples was listed too (20, and "... and 196 more"), told to be
    # removed "from data.jsonl or from data.jsonl"
    assert msg.startswith("team search: 1 problem(s):\n") and len(msg.splitlines()) == 2, msg


def test_a_copy_of_the_scored_file_as_fewshot_file_is_listed_capped_and_a_shared_file_worded_as_one(
    example_evals, tmp_path
):
    from quantgate.fewshot import leaks

    search = example_evals / "search"
    (search / "shots.jsonl").write_bytes((search / "data.jsonl").read_bytes())
    edit_task(
        search / "capitals.yaml",
        num_fewshot=2,
        fewshot_split="train",
        dataset_kwargs={"data_files": {"test": "data.jsonl", "train": "shots.jsonl"}},
    )
    lines = refusal(search).splitlines()
    assert len(lines) == 22 and lines[-1] == f"  {search / 'shots.jsonl'}: ... and 196 more", lines[-2:]
    assert lines[1].endswith(
        "that document would be shown with its answer; remove it from shots.jsonl or from data.jsonl"
    )
    same = leaks(
        [(1, {"doc_to_text": "Q"})], [(1, {"doc_to_text": "Q"})], tmp_path / "d.jsonl", tmp_path / "d.jsonl", "x"
    )
    assert same == [
        f"{tmp_path / 'd.jsonl'}:1: this few-shot example (x) renders the prompt of the scored document "
        f"{tmp_path / 'd.jsonl'}:1 ('Q'): that document would be shown with its answer; put the few-shot examples "
        "in a file of their own"
    ]


def test_a_fewshot_example_equal_to_a_scored_document_after_rendering_is_refused_at_its_line(
    example_evals, monkeypatch
):
    support = example_evals / "support"
    scored = [json.loads(line) for line in (support / "data.jsonl").read_text().splitlines()]
    shots = [json.loads(line) for line in (support / "fewshot.jsonl").read_text().splitlines()]
    shots[2] = {**scored[9], "id": "shot-3", "message": f"  {scored[9]['message']} "}  # same prompt once rendered
    write_jsonl(support / "fewshot.jsonl", shots)
    msg = refusal(support)
    assert (
        f"{support / 'fewshot.jsonl'}:3: this few-shot example (fewshot_split) renders the prompt of the scored "
        f"document {support / 'data.jsonl'}:10 " in msg
    )
    [task] = lm_eval_tasks(support, monkeypatch).values()  # lm-eval would put it in every prompt (first_n)
    assert task.doc_to_text(task.fewshot_docs()[2]).split() == task.doc_to_text(task.eval_docs[9]).split()


def test_a_disjoint_fewshot_file_is_accepted_and_its_examples_are_the_ones_lm_eval_samples(example_evals, monkeypatch):
    docs = search_docs(example_evals)
    search = example_evals / "search"
    write_jsonl(search / "data.jsonl", docs[2:])
    write_jsonl(search / "shots.jsonl", docs[:2])
    edit_task(
        search / "capitals.yaml",
        num_fewshot=2,
        fewshot_split="train",
        fewshot_config={"sampler": "first_n"},
        dataset_kwargs={"data_files": {"test": "data.jsonl", "train": "shots.jsonl"}},
    )
    task = load_team(search).tasks[0]
    [lm_task] = lm_eval_tasks(search, monkeypatch).values()
    assert list(task.docs) == list(lm_task.eval_docs) == docs[2:] and list(lm_task.fewshot_docs()) == docs[:2]
