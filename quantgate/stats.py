"""Paired non-inferiority statistics for the gate.

The question per (build, team): is the candidate at most `margin` worse than the 16-bit
build on the same documents? Inputs are per-document drops d_i = baseline_i - candidate_i
(sign flipped for lower-is-better metrics), so drop > 0 means the candidate is worse.

- 0/1 metrics: Tango's score interval for the difference of paired proportions
  (T. Tango, "Equivalence test and confidence interval for the difference in proportions
  for the paired-sample design", Statistics in Medicine 17:891-908, 1998), which behaves
  at b = c = 0 where Wald intervals collapse; plus the exact McNemar p-value (binomial test
  on the discordant pairs) for "is there any difference at all".
- other metrics: paired bootstrap of the mean drop (scipy.stats.bootstrap, fixed seed).

Both give a two-sided interval [lower, upper] whose one-sided bounds each have confidence
`confidence`; the gate compares them with the margin (see `verdict`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import Enum

import numpy as np
from scipy import optimize, stats

TOLERANCE = 1e-9  # metric units; far below any meaningful margin


class Verdict(str, Enum):
    PASS = "PASS"  # upper bound of the drop <= margin
    FAIL = "FAIL"  # lower bound of the drop > margin: worse beyond the margin, with confidence
    INCONCLUSIVE = "INCONCLUSIVE"  # the set is too small to tell
    ANOMALOUS = "ANOMALOUS"  # candidate better than baseline by more than the margin, with confidence


# mildest first: a build's verdict is its worst team's (pipeline/gate.py)
SEVERITY = [Verdict.PASS, Verdict.INCONCLUSIVE, Verdict.ANOMALOUS, Verdict.FAIL]


# Not a verdict but a role: the 16-bit build the gate judges every other build against is never judged
# itself; where a verdict stands for a build (tag gate.verdict, the buys plot) it says BASELINE instead.
BASELINE = "BASELINE"


@dataclass(frozen=True)
class Comparison:
    """Result of one paired comparison; drops in metric units (0.05 = 5 points)."""

    method: str
    n: int
    drop: float  # mean drop (baseline - candidate)
    lower: float  # one-sided lower confidence bound of the drop
    upper: float  # one-sided upper confidence bound of the drop
    p_value: float  # one-sided p of H0: drop >= margin (small = non-inferior)
    p_difference: float  # two-sided p of H0: drop == 0 (exact McNemar for 0/1)
    n_required: int | None  # docs needed to decide at the observed rates (None: more data will not pass)
    discordant: tuple[int, int] | None = None  # (b, c) for 0/1 metrics

    def as_dict(self) -> dict:
        return asdict(self)


def _tango_z(b: float, c: float, n: float, delta: float) -> float:
    """Tango's score statistic for H0: drop = delta, b = #(base 1, cand 0), c = #(base 0, cand 1)."""
    a_ = 2.0 * n
    b_ = -b - c + (2.0 * n - b + c) * delta
    c_ = -c * delta * (1.0 - delta)
    p21 = (math.sqrt(max(b_ * b_ - 4.0 * a_ * c_, 0.0)) - b_) / (2.0 * a_)
    var = n * (2.0 * p21 + delta * (1.0 - delta))
    num = b - c - n * delta
    if var <= 0.0:
        return math.copysign(math.inf, num) if num else 0.0
    return num / math.sqrt(var)


def tango_bounds(b: float, c: float, n: float, confidence: float) -> tuple[float, float]:
    """One-sided (lower, upper) confidence bounds of the paired drop (b - c) / n (Tango 1998).

    Each bound has one-sided level `confidence`. Raises ValueError if n <= 0 or b + c > n.
    """
    if n <= 0 or b < 0 or c < 0 or b + c > n:
        raise ValueError(f"need 0 <= b, c and b + c <= n > 0; got b={b}, c={c}, n={n}")
    z = stats.norm.ppf(confidence)
    est = (b - c) / n
    eps = 1e-12
    f_up = lambda d: _tango_z(b, c, n, d) + z  # noqa: E731  decreasing in d
    upper = 1.0 if f_up(1.0 - eps) >= 0 else optimize.brentq(f_up, est, 1.0 - eps, xtol=1e-12)
    f_lo = lambda d: _tango_z(b, c, n, d) - z  # noqa: E731
    lower = -1.0 if f_lo(-1.0 + eps) <= 0 else optimize.brentq(f_lo, -1.0 + eps, est, xtol=1e-12)
    return lower, upper


def compare_binary(base: np.ndarray, cand: np.ndarray, margin: float, confidence: float) -> Comparison:
    """Paired comparison of 0/1 scores (arrays of shape (n,), same document order)."""
    n = len(base)
    b = int(np.sum((base == 1) & (cand == 0)))
    c = int(np.sum((base == 0) & (cand == 1)))
    lower, upper = tango_bounds(b, c, n, confidence)
    p_ni = float(stats.norm.cdf(_tango_z(b, c, n, margin))) if margin < 1 else 0.0
    p_diff = float(stats.binomtest(b, b + c, 0.5).pvalue) if b + c else 1.0
    return Comparison(
        "tango-score",
        n,
        (b - c) / n,
        lower,
        upper,
        p_ni,
        p_diff,
        _n_required_binary(b / n, c / n, n, margin, confidence),
        (b, c),
    )


def _n_required_binary(pb: float, pc: float, n: int, margin: float, confidence: float) -> int | None:
    """Smallest n' whose Tango upper bound at the same discordant rates is <= margin."""
    if pb - pc >= margin:
        return None
    if tango_bounds(pb * n, pc * n, n, confidence)[1] <= margin:
        return n
    hi = n
    while tango_bounds(pb * hi, pc * hi, hi, confidence)[1] > margin:
        hi *= 2
        if hi > 10_000_000:
            return None
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tango_bounds(pb * mid, pc * mid, mid, confidence)[1] <= margin:
            hi = mid
        else:
            lo = mid
    return hi


# Resampled documents held at once by the bootstrap: scipy holds n x batch indices and values, 16 bytes each
# (measured: 305 MiB for n = 1,000 x 20,000 resamples unbatched), so at most 64 MiB whatever n and resamples
BOOTSTRAP_ELEMENTS = 1 << 22


def compare_continuous(drops: np.ndarray, margin: float, confidence: float, resamples: int, seed: int) -> Comparison:
    """Paired bootstrap of the mean per-document drop (array of shape (n,)).

    Percentile interval at two-sided level 2*confidence - 1, so each bound is one-sided at
    `confidence` (scipy.stats.bootstrap). With n = 1 or all drops equal the interval is the
    point itself (no spread to resample).
    """
    n = len(drops)
    est = float(np.mean(drops))
    if n < 2 or np.all(drops == drops[0]):
        lower = upper = est
        boot = np.full(1, est)
    else:
        res = stats.bootstrap(
            (drops,),
            np.mean,
            confidence_level=2 * confidence - 1,
            n_resamples=resamples,
            method="percentile",
            random_state=np.random.default_rng(seed),
            batch=max(1, BOOTSTRAP_ELEMENTS // n),  # the same draws as all at once (same seed), in bounded memory
        )
        lower, upper = float(res.confidence_interval.low), float(res.confidence_interval.high)
        boot = res.bootstrap_distribution
    # p of H0 drop >= margin: the bootstrap shifted to the null (mean = margin) at or below est
    p_ni = float(np.mean((boot - est + margin) <= est)) if n >= 2 else float(est >= margin)
    p_diff = float(stats.ttest_1samp(drops, 0.0).pvalue) if n >= 2 and np.std(drops) > 0 else 1.0
    sd = float(np.std(drops, ddof=1)) if n >= 2 else 0.0
    gap = margin - est
    need = (stats.norm.ppf(confidence) * sd / gap) ** 2 if gap > 0 and sd > 0 else 0.0
    # no finite count (a spread far beyond the gap): as if more documents cannot make it pass
    n_req = None if gap <= 0 or not math.isfinite(need) else max(n, math.ceil(need))
    return Comparison("paired-bootstrap", n, est, lower, upper, p_ni, p_diff, n_req)


def is_binary(*arrays: np.ndarray) -> bool:
    """True when every value is exactly 0 or 1."""
    return all(np.all((a == 0) | (a == 1)) for a in arrays)


def verdict(cmp: Comparison, margin: float) -> Verdict:
    """PASS if upper <= margin; FAIL if lower > margin; ANOMALOUS if upper < -margin; else INCONCLUSIVE.

    Comparisons allow TOLERANCE so a drop exactly at the margin is not lost to float rounding.
    """
    return verdict_of(cmp.lower, cmp.upper, margin)


def verdict_of(lower: float, upper: float, margin: float) -> Verdict:
    """verdict() from the drop's bounds `lower`, `upper` and the `margin` alone (metric units), as a gate
    result stores them: a reader re-derives a stored verdict with it."""
    if lower > margin + TOLERANCE:
        return Verdict.FAIL
    if upper < -margin - TOLERANCE:
        return Verdict.ANOMALOUS
    if upper <= margin + TOLERANCE:
        return Verdict.PASS
    return Verdict.INCONCLUSIVE


def pass_probability(n: int, discordance: float, margin: float, confidence: float) -> float:
    """Probability that the gate PASSes a build as good as the baseline on n documents of a 0/1 metric.

    Model: each document flips between the builds with probability `discordance` (the share of discordant
    pairs, b + c over n), in either direction with probability 1/2, so the true drop is 0. The gate PASSes
    when Tango's upper bound (tango_bounds at `confidence`) is at most `margin`. Exact: sums the binomial
    distribution of the discordant count D and, given D, of b over the b values that PASS.
    Raises ValueError unless n > 0, 0 <= discordance <= 1 and margin > 0.
    """
    if n <= 0 or not 0 <= discordance <= 1 or margin <= 0:
        raise ValueError(f"need n > 0, 0 <= discordance <= 1, margin > 0; got {n}, {discordance}, {margin}")
    dist = stats.binom(n, discordance)
    lo, hi = (int(dist.ppf(1e-9)), int(dist.isf(1e-9))) if 0 < discordance < 1 else (round(n * discordance),) * 2
    total = 0.0
    for d in range(max(lo, 0), min(hi, n) + 1):
        # largest b (of d discordant pairs) whose upper bound still PASSes; the bound grows with b
        passes = lambda b, d=d: tango_bounds(b, d - b, n, confidence)[1] <= margin + TOLERANCE  # noqa: E731
        if not passes(0):
            continue
        lo_b, hi_b = 0, d
        while lo_b < hi_b:
            mid = (lo_b + hi_b + 1) // 2
            lo_b, hi_b = (mid, hi_b) if passes(mid) else (lo_b, mid - 1)
        total += dist.pmf(d) * stats.binom(d, 0.5).cdf(lo_b)
    return float(total)


def docs_for_power(discordance: float, margin: float, confidence: float, power: float = 0.9) -> int:
    """Smallest document count n at which a build as good as the baseline PASSes with probability >= `power`
    (pass_probability), for a 0/1 metric whose builds disagree on a share `discordance` of documents.

    Starts from the normal approximation n = (z_conf + z_power)^2 * discordance / margin^2 (Connor 1987,
    Biometrics 43:207-211, for paired proportions at a true difference of 0) and steps it to the exact answer.
    Raises ValueError if no n up to 1,000,000 reaches `power`.
    """
    z = stats.norm.ppf(confidence) + stats.norm.ppf(power)
    n = max(1, math.ceil(z * z * discordance / (margin * margin)))
    step = max(1, n // 20)
    while pass_probability(n, discordance, margin, confidence) < power:
        n += step
        if n > 1_000_000:
            raise ValueError(f"no n up to 1,000,000 reaches power {power} at margin {margin}")
    while n > 1 and pass_probability(n - 1, discordance, margin, confidence) >= power:
        n -= 1
    return n
