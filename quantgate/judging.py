"""The gate's judgement of one (candidate build, team): paired per-document scores against the team's
non-inferiority margin (quantgate/stats.py), as a TeamComparison.

Shared by the gate stage (every build on the full sets) and the search stage (screening candidates).
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import Field, field_validator

from quantgate.errors import QuantgateError
from quantgate.params import BASELINE_BUILD, Frozen
from quantgate.results import Sample, TeamComparison, TeamScores
from quantgate.stats import Verdict, compare_binary, compare_continuous, is_binary, verdict
from quantgate.teams import Team


class GateBlock(Frozen):
    """params.yaml block `gate`."""

    baseline: str = BASELINE_BUILD
    # each resample is a mean over the team's n documents (stats.compare_continuous, memory bounded by batches):
    # 10**9 passed validate and would have run for days; 100,000 of a 1,000-document set take seconds
    bootstrap_resamples: int = Field(default=10000, ge=1000, le=100_000)
    seed: int = Field(default=0, ge=0)  # the bootstrap's np.random.default_rng refuses a negative one

    @field_validator("baseline")
    @classmethod
    def _the_16bit_build(cls, value: str) -> str:
        if value != BASELINE_BUILD:  # read here, so validate refuses it before any build is made
            raise ValueError(
                f"{value!r} is not the 16-bit build; the baseline is the one prepare makes, {BASELINE_BUILD!r}"
            )
        return value


def paired_arrays(
    base: TeamScores, cand: TeamScores, base_build: str, cand_build: str
) -> tuple[np.ndarray, np.ndarray]:
    """Per-document scores of both builds in the same order, shape (n,) each.

    Raises QuantgateError if the document sets differ (ids, count or content hash) or a
    score is missing, NaN or infinite (no interval of the drop is finite then: the gate wrote a PASS with
    lower bound -inf, which `quantgate report` and register rightly refuse as no verdict).
    """

    def index(scores: TeamScores, build: str) -> dict[tuple[str, int], Sample]:
        out = {}
        for s in scores.samples:
            key = (s.task, s.doc_id)
            if s.score is None or not math.isfinite(s.score):
                raise QuantgateError(f"build {build}: score of {key[0]} doc {key[1]} is {s.score!r}")
            if key in out:
                raise QuantgateError(f"build {build}: {key[0]} doc {key[1]} scored twice")
            out[key] = s
        if not out:
            raise QuantgateError(f"build {build}: no per-sample scores")
        return out

    b, c = index(base, base_build), index(cand, cand_build)
    if b.keys() != c.keys():
        only_b, only_c = sorted(b.keys() - c.keys())[:3], sorted(c.keys() - b.keys())[:3]
        raise QuantgateError(
            f"document sets differ: {len(b)} docs on {base_build} vs {len(c)} on {cand_build}"
            f" (only {base_build}: {only_b}; only {cand_build}: {only_c})"
        )
    keys = sorted(b)
    for k in keys:
        if b[k].doc_hash != c[k].doc_hash:
            raise QuantgateError(f"{k[0]} doc {k[1]}: document content differs between {base_build} and {cand_build}")
    return np.array([b[k].score for k in keys], float), np.array([c[k].score for k in keys], float)


def judge(
    team: Team, base_scores: TeamScores, cand_scores: TeamScores, params: GateBlock, build: str
) -> TeamComparison:
    """The gate's comparison of one (candidate build, team)."""
    base, cand = paired_arrays(base_scores, cand_scores, params.baseline, build)
    pol = team.policy
    # scores near the float range: a sum, a difference or a square overflows to inf, said below (not also as
    # numpy's RuntimeWarning in the stage log)
    with np.errstate(over="ignore", invalid="ignore"):
        base_mean, cand_mean = float(base.mean()), float(cand.mean())
        drops = base - cand if pol.higher_is_better else cand - base
        spread = float(np.std(drops)) if len(drops) else 0.0
    if not all(map(math.isfinite, (base_mean, cand_mean, spread, *drops))):
        raise QuantgateError(
            f"build {build}: the {pol.metric} scores are too large to compare (a per-document drop, a mean or their "
            "spread overflows a float); check the metric"
        )
    margin = pol.margin.points(base_mean)
    if is_binary(base, cand):
        cmp = (
            compare_binary(base, cand, margin, pol.confidence)
            if pol.higher_is_better
            else compare_binary(cand, base, margin, pol.confidence)
        )
    else:
        cmp = compare_continuous(drops, margin, pol.confidence, params.bootstrap_resamples, params.seed)
    v = verdict(cmp, margin)
    if pol.higher_is_better:
        recovery = 100.0 * cand_mean / base_mean if base_mean else None
    else:
        recovery = 100.0 * base_mean / cand_mean if cand_mean else None
    return TeamComparison(
        verdict=v,
        metric=pol.metric,
        higher_is_better=pol.higher_is_better,
        n=cmp.n,
        baseline=base_mean,
        candidate=cand_mean,
        delta=cand_mean - base_mean,
        margin=margin,
        recovery_pct=recovery,
        confidence=pol.confidence,
        **{k: val for k, val in cmp.as_dict().items() if k != "n"},
        reason=reason(v, cmp, margin),
    )


def reason(v: Verdict, cmp, margin: float) -> str:
    """One line explaining a verdict in metric units."""
    if v is Verdict.PASS:
        return f"upper bound of drop {cmp.upper:+.3f} <= margin {margin:.3f}"
    if v is Verdict.FAIL:
        return f"drop {cmp.drop:+.3f} exceeds margin {margin:.3f} with confidence (lower bound {cmp.lower:+.3f})"
    if v is Verdict.ANOMALOUS:
        return f"candidate better by {-cmp.drop:.3f}, beyond the margin with confidence: check the comparison"
    need = f"about {cmp.n_required} docs would decide it" if cmp.n_required else "more docs will not make it pass"
    return f"upper bound of drop {cmp.upper:+.3f} > margin {margin:.3f}; n={cmp.n} is too small to tell ({need})"
