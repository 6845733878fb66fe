"""One set of rules whichever way validate is called: one team's folder is checked with every rule the all-teams
check applies, task names against its own files and its sibling teams' included; and evaluate fails a team closed
unless lm-eval scored exactly the tasks, and documents, that validate listed."""

import shutil

import pytest
from click.testing import CliRunner

from cli.main import cli
from quantgate.errors import QuantgateError
from quantgate.scoring import check_scored
from quantgate.teams import load_team, load_teams
from tests.test_eval_loading import datasets_cache_in_tmp, lm_eval_tasks  # noqa: F401


def test_two_task_files_of_one_name_are_refused_by_the_one_folder_and_the_all_teams_check(example_evals, monkeypatch):
    search = example_evals / "search"
    shutil.copyfile(search / "capitals.yaml", search / "capitals_copy.yaml")
    expected = (
        f"{search / 'capitals_copy.yaml'}:3: task name 'search_capitals' already used by {search / 'capitals.yaml'} "
        "in this team's folder; rename one"
    )
    one = CliRunner().invoke(cli, ["evals", "validate", str(search)])
    every = CliRunner().invoke(cli, ["evals", "validate", str(example_evals)])
    assert one.exit_code == every.exit_code == 1 and expected in one.output and expected in every.output
    assert list(lm_eval_tasks(search, monkeypatch)) == ["search_capitals"]  # lm-eval would keep one of the two


def test_a_task_name_another_team_uses_is_refused_when_one_folder_is_checked(example_evals):
    support = example_evals / "support"
    task = support / "sentiment.yaml"
    task.write_text(task.read_text().replace("task: support_sentiment", "task: search_capitals"))
    msg = f"{task}:3: task name 'search_capitals' already used by {example_evals / 'search' / 'capitals.yaml'}"
    for check in (lambda: load_team(support), lambda: load_teams(example_evals)):
        with pytest.raises(QuantgateError) as err:
            check()
        assert msg in str(err.value) and "team support:" in str(err.value)
    with pytest.raises(QuantgateError) as err:  # the other holder of the name is told too
        load_team(example_evals / "search")
    assert f"task name 'search_capitals' already used by {task}" in str(err.value)


def test_a_sibling_with_problems_of_its_own_does_not_fail_the_folder_checked(example_evals):
    (example_evals / "billing" / "data.jsonl").write_text("not json\n")
    assert [t.name for t in load_team(example_evals / "search").tasks] == ["search_capitals"]
    with pytest.raises(QuantgateError, match="team billing: "):
        load_teams(example_evals)


def results_for(team, counts: dict[str, int]) -> dict:
    """lm-eval's results dict with `counts[task]` logged samples (filter none) per task."""
    return {"samples": {name: [{"doc_id": i, "filter": "none"} for i in range(n)] for name, n in counts.items()}}


def test_evaluate_fails_a_team_closed_unless_lm_eval_scored_exactly_the_validated_tasks(example_evals):
    team = load_team(example_evals / "search")
    check_scored(team, results_for(team, {"search_capitals": 216}), None)
    check_scored(team, results_for(team, {"search_capitals": 40}), 40)
    with pytest.raises(QuantgateError, match=r"scored tasks \['other', 'search_capitals'\], but validate listed"):
        check_scored(team, results_for(team, {"search_capitals": 216, "other": 3}), None)
    with pytest.raises(QuantgateError, match=r"lm-eval scored tasks \[\], but validate listed \['search_capitals'\]"):
        check_scored(team, results_for(team, {}), None)
    with pytest.raises(QuantgateError, match="search_capitals: lm-eval scored 215 documents, but validate counted 216"):
        check_scored(team, results_for(team, {"search_capitals": 215}), None)


def test_the_problem_count_counts_the_lines_a_long_listing_leaves_out():
    from quantgate.teams import _listing

    problems = [
        "t.yaml:3: bad key",
        "data.jsonl:1: bad label",
        "data.jsonl: ... and 196 more",
        "b.jsonl: ... and 2 more",
    ]
    assert _listing("search", problems).splitlines()[0] == "team search: 200 problem(s):"
    assert _listing("search", problems[:2]).splitlines()[0] == "team search: 2 problem(s):"
