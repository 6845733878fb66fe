"""Sequential screens: a candidate build is judged on more documents until the gate's interval decides it, or
the search's document budget ends.

A screen of a candidate looks at each team on the first `looks[0]` documents of each of its tasks, then on
`looks[1]`, ... (growing prefixes, as lm-eval's `limit` takes them). At each look the gate's own comparison
(quantgate.judging.judge: Tango's interval for 0/1 metrics, the paired bootstrap otherwise) is made at a
confidence spent across the looks, so that looking again does not inflate the error rate: Bonferroni over
the most looks a screen can take, 1 - (1 - confidence) / len(looks), the split the canary's checks use
(canary/analysis.py). A team is decided when the interval's upper bound of the drop is within its margin
(PASS; ANOMALOUS, better beyond the margin, counts as within it) or its lower bound is beyond it (FAIL). The
candidate

- fails at the first team decided FAIL (no more documents are spent on it);
- passes once every team is decided PASS;
- is undecided when a team is still undecided after the last look, after its whole set, or when the next
  look would overrun the budget. An undecided screen is reported as such; its point estimates are not a
  verdict, so the search never chooses it as passing.

The budget counts the candidate documents scored (each look re-scores its prefix: lm-eval has no offset),
summed over every look, team and candidate of the search.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from quantgate.results import TeamComparison
from quantgate.stats import Verdict


class Outcome(str, Enum):
    PASS = "pass"  # every team decided within its margin
    FAIL = "fail"  # a team decided beyond its margin
    UNDECIDED = "undecided"  # the looks, a team's documents or the budget ran out first


def look_confidence(confidence: float, looks: int) -> float:
    """The confidence of one look when a screen may look `looks` times at a team whose policy asks for
    `confidence` (Bonferroni: the error rate 1 - confidence split evenly over the looks)."""
    return 1.0 - (1.0 - confidence) / looks


@dataclass
class Budget:
    """Candidate documents the search may score in all (search.doc_budget) and how many it has."""

    total: int
    spent: int = 0

    def allows(self, docs: int) -> bool:
        """Whether `docs` more documents fit."""
        return self.spent + docs <= self.total


@dataclass
class ScreenRun:
    """What one sequential screen found: the outcome, each team's comparison at its last look, the
    documents scored, and one line per look ("<docs per task>: team PASS, team INCONCLUSIVE, ...")."""

    outcome: Outcome
    teams: dict[str, TeamComparison]
    docs: int = 0
    trail: list[str] = field(default_factory=list)


def _decided(c: TeamComparison) -> bool:
    return c.verdict in (Verdict.PASS, Verdict.ANOMALOUS, Verdict.FAIL)


def sequential(
    teams: list[str],
    looks: list[int],
    judge_at: Callable[[str, int], tuple[TeamComparison, int, bool]],
    cost: Callable[[str, int], int],
    budget: Budget,
) -> ScreenRun:
    """Screen one candidate (module docstring). `judge_at(team, limit)` scores the team on the first `limit`
    documents per task and returns (the comparison at the look's confidence, documents scored, whether the
    team's whole set was scored); `cost(team, limit)` says how many documents that look would score, before
    it is scored. Spends `budget`. Returns the ScreenRun."""
    run = ScreenRun(Outcome.UNDECIDED, {})
    open_teams, whole = list(teams), set()
    for limit in looks:
        looked = []
        for team in [t for t in open_teams if t not in whole]:
            if not budget.allows(cost(team, limit)):
                run.trail.append(f"{limit}: the document budget ({budget.total}) ends before {team}")
                return run
            c, docs, all_scored = judge_at(team, limit)
            budget.spent += docs
            run.docs += docs
            run.teams[team] = c
            looked.append(f"{team} {Verdict(c.verdict).value}")
            if all_scored:
                whole.add(team)
            if c.verdict == Verdict.FAIL:
                run.trail.append(f"{limit}: " + ", ".join(looked))
                run.outcome = Outcome.FAIL
                return run
            if _decided(c):
                open_teams.remove(team)
        run.trail.append(f"{limit}: " + ", ".join(looked))
        if not open_teams:
            run.outcome = Outcome.PASS
            return run
        if all(t in whole for t in open_teams):
            break
    return run
