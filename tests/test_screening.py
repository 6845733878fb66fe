"""Sequential screens (quantgate/screening.py): a candidate looks at more documents until each team's interval
decides it, spends a document budget, stops at the first FAIL, and says "undecided" rather than guess."""

import numpy as np
import pytest

from quantgate.results import TeamComparison
from quantgate.screening import Budget, Outcome, look_confidence, sequential
from quantgate.stats import compare_binary, verdict

LOOKS = [40, 80, 160]


def comparison(v: str, n: int) -> TeamComparison:
    return TeamComparison(
        verdict=v,
        metric="acc",
        higher_is_better=True,
        n=n,
        baseline=0.5,
        candidate=0.5,
        delta=0.0,
        margin=0.08,
        confidence=0.95,
        method="tango",
        drop=0.0,
        lower=-0.1,
        upper=0.1,
        p_value=0.5,
        p_difference=1.0,
        n_required=None,
        reason="scripted",
    )


def scripted(verdicts: dict[str, dict[int, str]], docs: dict[str, int] | None = None):
    """judge_at and cost for teams whose verdict at each look is given; `docs`: a team's documents per task."""
    docs = docs or {}
    calls = []

    def cost(team, limit):
        return min(limit, docs.get(team, 10**6))

    def judge_at(team, limit):
        calls.append((team, limit))
        n = cost(team, limit)
        return comparison(verdicts[team][limit], n), n, n < limit

    return judge_at, cost, calls


def test_a_look_spends_the_error_rate_over_the_looks():
    assert look_confidence(0.95, 1) == pytest.approx(0.95)
    assert look_confidence(0.95, 3) == pytest.approx(1 - 0.05 / 3)


def test_teams_decided_early_are_not_scored_again_and_the_candidate_passes_when_all_are_decided():
    judge_at, cost, calls = scripted({"billing": {40: "PASS"}, "search": {40: "INCONCLUSIVE", 80: "PASS"}})
    budget = Budget(1000)
    run = sequential(["billing", "search"], LOOKS, judge_at, cost, budget)
    assert run.outcome == Outcome.PASS and calls == [("billing", 40), ("search", 40), ("search", 80)]
    assert run.trail == ["40: billing PASS, search INCONCLUSIVE", "80: search PASS"]
    assert run.docs == budget.spent == 160 and run.teams["search"].n == 80


def test_the_first_team_beyond_its_margin_fails_the_candidate_and_spends_nothing_more():
    judge_at, cost, calls = scripted({"billing": {40: "FAIL"}, "search": {40: "PASS"}})
    run = sequential(["billing", "search"], LOOKS, judge_at, cost, Budget(1000))
    assert run.outcome == Outcome.FAIL and calls == [("billing", 40)] and run.trail == ["40: billing FAIL"]


def test_a_better_candidate_beyond_the_margin_counts_as_within_it():
    judge_at, cost, _ = scripted({"support": {40: "ANOMALOUS"}})
    assert sequential(["support"], LOOKS, judge_at, cost, Budget(1000)).outcome == Outcome.PASS


def test_undecided_when_the_looks_the_documents_or_the_budget_run_out():
    always = {40: "INCONCLUSIVE", 80: "INCONCLUSIVE", 160: "INCONCLUSIVE"}
    judge_at, cost, calls = scripted({"billing": always})
    run = sequential(["billing"], LOOKS, judge_at, cost, Budget(1000))
    assert run.outcome == Outcome.UNDECIDED and [limit for _, limit in calls] == LOOKS and run.docs == 280
    # a team of 30 documents: its whole set is scored at the first look, the later looks would add nothing
    judge_at, cost, calls = scripted({"billing": always}, docs={"billing": 30})
    run = sequential(["billing"], LOOKS, judge_at, cost, Budget(1000))
    assert run.outcome == Outcome.UNDECIDED and calls == [("billing", 40)] and run.docs == 30
    # a budget of 100: the look at 80 would overrun it
    judge_at, cost, calls = scripted({"billing": always})
    budget = Budget(100)
    run = sequential(["billing"], LOOKS, judge_at, cost, budget)
    assert run.outcome == Outcome.UNDECIDED and calls == [("billing", 40)] and budget.spent == 40
    assert run.trail[-1] == "80: the document budget (100) ends before billing"


def test_an_identical_build_is_undecided_on_few_documents_and_passes_on_more_at_the_spent_confidence():
    # the gate's own interval (Tango) on 0/1 scores: identical builds, half the documents right
    margin, confidence = 0.08, look_confidence(0.95, len(LOOKS))

    def judge_at(team, limit):
        scores = np.arange(limit) % 2
        cmp = compare_binary(scores, scores, margin, confidence)
        return comparison(verdict(cmp, margin).value, limit), limit, False

    run = sequential(["billing"], LOOKS, judge_at, lambda team, limit: limit, Budget(1000))
    first = compare_binary(np.zeros(40), np.zeros(40), margin, confidence)
    assert first.upper > margin  # 40 documents cannot show non-inferiority at this confidence
    assert run.outcome == Outcome.PASS and run.trail[0] == "40: billing INCONCLUSIVE"
    assert run.teams["billing"].n in (80, 160)
