"""Loading team eval sets: the shipped examples, and clear errors on bad input."""
import pytest

from evals.teams import load_team, load_teams
from pipeline.errors import QuantgateError


def test_examples_load(example_evals):
    teams = {t.name: t for t in load_teams(example_evals)}
    assert sorted(teams) == ["billing", "search", "support"]
    assert teams["support"].policy.margin.points(0.8) == pytest.approx(0.08)  # relative 10 %
    assert teams["search"].policy.margin.points(0.3) == 0.05
    task = teams["search"].tasks[0]
    assert task.name == "search_capitals"
    assert task.config["dataset_kwargs"]["data_files"]["test"].endswith("evals/search/data.jsonl")


def test_digest_changes_with_data_only_for_that_team(example_evals):
    before = {t.name: t.digest for t in load_teams(example_evals)}
    with open(example_evals / "billing" / "data.jsonl", "a") as f:
        f.write('{"id": "x", "question": "What is 1 + 1?", "answer": "2"}\n')
    after = {t.name: t.digest for t in load_teams(example_evals)}
    assert after["billing"] != before["billing"]
    assert after["search"] == before["search"] and after["support"] == before["support"]


def test_missing_margin_names_file_and_field(example_evals):
    p = example_evals / "search" / "team.yaml"
    p.write_text(p.read_text().replace("margin:\n  absolute: 0.05", ""))
    with pytest.raises(QuantgateError, match=r"search/team.yaml\.margin: Field required"):
        load_team(example_evals / "search")


def test_both_margins_refused(example_evals):
    p = example_evals / "search" / "team.yaml"
    p.write_text(p.read_text().replace("absolute: 0.05", "absolute: 0.05\n  relative: 5"))
    with pytest.raises(QuantgateError, match="exactly one of margin.absolute"):
        load_team(example_evals / "search")


def test_unknown_metric_named(example_evals):
    p = example_evals / "search" / "team.yaml"
    p.write_text(p.read_text().replace("metric: acc", "metric: accuracy"))
    with pytest.raises(QuantgateError, match="metric 'accuracy' is not in metric_list"):
        load_team(example_evals / "search")


def test_invalid_yaml_has_line(example_evals):
    (example_evals / "search" / "team.yaml").write_text("owner: a\nmargin: [unclosed\n")
    with pytest.raises(QuantgateError, match=r"team.yaml:\d+: invalid YAML"):
        load_team(example_evals / "search")


def test_duplicate_task_names_across_teams(example_evals):
    p = example_evals / "support" / "sentiment.yaml"
    p.write_text(p.read_text().replace("task: support_sentiment", "task: search_capitals"))
    with pytest.raises(QuantgateError, match="task name 'search_capitals' already used"):
        load_teams(example_evals)


BAD_LINES = [
    ('{"id": "a", "question": "Q?", "choices": ["x", "y"], "answer": 1}\n{"id": "b", ', "data.jsonl:2: invalid JSON"),
    ('{"id": "a", "question": "Q?", "choices": ["x", "y"], "answer": 1}\n\n{"id": "c", "question": "Q?", "choices": ["x", "y"], "answer": 0}\n',
     "data.jsonl:2: blank line"),
    ('{"id": "a", "question": "Q?", "choices": ["x", "y"], "answer": 2}\n', "data.jsonl:1: answer=2 is not an index into 2 choices"),
    ('{"id": "a", "question": "Q?", "choices": ["x", "y"], "answer": "y"}\n', "answer is the answer text 'y'; use its index 1"),
    ('{"id": "a", "question": "Q?", "choices": ["x", "x"], "answer": 0}\n', "data.jsonl:1: duplicate choices"),
    ('{"id": "a", "question": "Q?", "choices": [], "answer": 0}\n', "choices must be a non-empty list"),
    ('{"id": "a", "question": "Q?", "answer": 0}\n', "field 'choices' (doc_to_choice) is missing"),
]


@pytest.mark.parametrize("content, expected", BAD_LINES)
def test_bad_data_lines_named_with_file_and_line(example_evals, content, expected):
    (example_evals / "search" / "data.jsonl").write_text(content)
    with pytest.raises(QuantgateError) as err:
        load_team(example_evals / "search")
    assert expected in str(err.value)


def test_non_utf8_named_with_line(example_evals):
    (example_evals / "search" / "data.jsonl").write_bytes(
        b'{"id": "a", "question": "Q?", "choices": ["x", "y"], "answer": 1}\n{"id": "caf\xe9"}\n')
    with pytest.raises(QuantgateError, match=r"data.jsonl:2: not UTF-8 \(byte 0xe9\)"):
        load_team(example_evals / "search")
