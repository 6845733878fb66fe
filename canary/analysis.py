"""Judge one canary step: the candidate against stable, from the router's samples.

Checks, each a one-sided test at level `policy.alpha`:
- error_rate: share of candidate attempts that failed (5xx, timeout, connection error, a
  stream cut after its first byte), counted before the retry on stable. Exact binomial test
  of H1: rate > max_error_rate, p = P(X >= k | n, max_error_rate)
  (scipy.stats.binomtest, alternative="greater").
- ttft_p95_ratio / tpot_p95_ratio: p95(candidate) / p95(stable) over successful streaming
  attempts (p95: numpy.percentile, linear interpolation, Hyndman & Fan type 7), with the
  Mann-Whitney U test of H1: candidate latencies are stochastically greater than stable's
  (H. B. Mann & D. R. Whitney, Ann. Math. Statist. 18:50-60, 1947;
  scipy.stats.mannwhitneyu, alternative="greater"; exact for small samples without ties,
  normal approximation with tie correction otherwise).
- shadow_agreement: share of sampled greedy candidate answers equal to the fp16 build's on
  the first policy.shadow_compare_words words. Exact binomial test of H1: agreement <
  min_shadow_agreement, p = P(X <= k | n, min_shadow_agreement) (alternative="less").

Verdict of a check: INCONCLUSIVE with fewer than policy.min_samples samples (per role for
latency); FAIL when the estimate is beyond the threshold AND the test is significant (p <
alpha); INCONCLUSIVE when it is beyond but not significant (more data may decide); PASS
when the estimate is within the threshold. So FAIL needs evidence and PASS needs
min_samples. A step: any FAIL -> FAIL, else any INCONCLUSIVE -> INCONCLUSIVE, else PASS.

alpha holds per check and per look: four checks looked at several times per step make a
false FAIL more likely than alpha, which policy.failure_limit (FAILs before abort) offsets.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from canary.metrics import Sample, ShadowSample
from canary.policy import CanaryPolicy
from quantgate.stats import Verdict


@dataclass(frozen=True)
class Check:
    """One check of one step. value None = no data; p_value None = not tested (too few samples);
    n = candidate samples (latency text also gives stable's)."""

    name: str
    value: float | None
    threshold: float
    p_value: float | None
    n: int
    verdict: Verdict
    text: str  # one line: "shadow_agreement 0.41 < 0.70 (n=37, p=0.0004) FAIL"


@dataclass(frozen=True)
class StepResult:
    verdict: Verdict
    checks: tuple[Check, ...]


def _judge(
    name: str,
    value: float | None,
    threshold: float,
    p: float | None,
    n: int,
    n_text: str,
    enough: bool,
    higher_is_worse: bool,
    alpha: float,
    fmt: str,
) -> Check:
    """Apply the verdict rule of the module docstring and write the check's line."""
    if value is None:
        return Check(
            name, None, threshold, None, n, Verdict.INCONCLUSIVE, f"{name} - ({n_text}) {Verdict.INCONCLUSIVE.value}"
        )
    beyond = value > threshold if higher_is_worse else value < threshold
    if not enough:
        verdict = Verdict.INCONCLUSIVE
    elif not beyond:
        verdict = Verdict.PASS
    else:
        verdict = Verdict.FAIL if p is not None and p < alpha else Verdict.INCONCLUSIVE
    op = (">" if beyond else "<=") if higher_is_worse else ("<" if beyond else ">=")
    p_text = f", p={p:.2g}" if p is not None else ""
    return Check(
        name,
        value,
        threshold,
        p,
        n,
        verdict,
        f"{name} {value:{fmt}} {op} {threshold:{fmt}} ({n_text}{p_text}) {verdict.value}",
    )


def error_rate_check(samples: Iterable[Sample], policy: CanaryPolicy) -> Check:
    """Candidate failure rate against policy.max_error_rate (exact binomial test, one-sided)."""
    cand = [s for s in samples if s.role == "candidate"]
    n, k = len(cand), sum(not s.ok for s in cand)
    enough = n >= policy.min_samples
    p = stats.binomtest(k, n, policy.max_error_rate, alternative="greater").pvalue if enough else None
    n_text = f"n={n}" if enough else f"n={n} < min {policy.min_samples}"
    return _judge(
        "error_rate",
        k / n if n else None,
        policy.max_error_rate,
        p,
        n,
        n_text,
        enough,
        higher_is_worse=True,
        alpha=policy.alpha,
        fmt=".3f",
    )


def p95_ratio(candidate: Sequence[float], stable: Sequence[float]) -> float:
    """p95(candidate) / p95(stable); inf when stable's p95 is 0 and candidate's is not."""
    c, s = float(np.percentile(candidate, 95)), float(np.percentile(stable, 95))
    if s > 0:
        return c / s
    return 1.0 if c == 0 else float("inf")


def latency_check(samples: Iterable[Sample], policy: CanaryPolicy, metric: str) -> Check:
    """p95 ratio of `metric` ("ttft" or "tpot") with the one-sided Mann-Whitney U test."""
    threshold = {"ttft": policy.max_ttft_p95_ratio, "tpot": policy.max_tpot_p95_ratio}[metric]
    values: dict[str, list[float]] = {"candidate": [], "stable": []}
    for s in samples:
        v = getattr(s, f"{metric}_s")
        if s.outcome == "ok" and v is not None and s.role in values:
            values[s.role].append(v)
    cand, stab = values["candidate"], values["stable"]
    enough = min(len(cand), len(stab)) >= policy.min_samples
    ratio = p95_ratio(cand, stab) if cand and stab else None
    p = float(stats.mannwhitneyu(cand, stab, alternative="greater").pvalue) if enough else None
    n_text = f"n={len(cand)}/{len(stab)}" + ("" if enough else f" < min {policy.min_samples}")
    return _judge(
        f"{metric}_p95_ratio",
        ratio,
        threshold,
        p,
        len(cand),
        n_text,
        enough,
        higher_is_worse=True,
        alpha=policy.alpha,
        fmt=".2f",
    )


def shadow_check(shadows: Iterable[ShadowSample], policy: CanaryPolicy) -> Check:
    """Agreement with the fp16 build against policy.min_shadow_agreement (exact binomial test, one-sided)."""
    shadows = list(shadows)
    n, k = len(shadows), sum(s.agree for s in shadows)
    enough = n >= policy.min_samples
    p = stats.binomtest(k, n, policy.min_shadow_agreement, alternative="less").pvalue if enough else None
    n_text = f"n={n}" if enough else f"n={n} < min {policy.min_samples}"
    return _judge(
        "shadow_agreement",
        k / n if n else None,
        policy.min_shadow_agreement,
        p,
        n,
        n_text,
        enough,
        higher_is_worse=False,
        alpha=policy.alpha,
        fmt=".2f",
    )


def combine(checks: Iterable[Check]) -> Verdict:
    """Any FAIL -> FAIL; else any INCONCLUSIVE -> INCONCLUSIVE; else PASS."""
    verdicts = {c.verdict for c in checks}
    if Verdict.FAIL in verdicts:
        return Verdict.FAIL
    return Verdict.INCONCLUSIVE if Verdict.INCONCLUSIVE in verdicts else Verdict.PASS


def analyze(samples: Sequence[Sample], shadows: Sequence[ShadowSample], policy: CanaryPolicy) -> StepResult:
    """All checks of a step from its samples (e.g. router.samples_since(step_start))."""
    checks = (
        error_rate_check(samples, policy),
        latency_check(samples, policy, "ttft"),
        latency_check(samples, policy, "tpot"),
        shadow_check(shadows, policy),
    )
    return StepResult(combine(checks), checks)


def live_line(step: int, percent: float, check: Check) -> str:
    """`step 2 (25%): shadow_agreement 0.41 < 0.70 (n=37, p=0.0004) FAIL` (step counted from 1)."""
    return f"step {step} ({percent:g}%): {check.text}"
