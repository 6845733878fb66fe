"""Judge one canary step: the candidate against stable, from the router's samples.

The checks are `policy.checks`, a list of ranges (canary/policy.py); each is judged as below.
`policy.alpha` bounds the probability that a canary of a build meeting every threshold aborts on
a false FAIL, over all its statistical checks, steps and looks. It is spent evenly (Bonferroni):
each of the k listed statistical checks (error_rate, the latency ratios, shadow_agreement) gets
alpha / (k * len(steps)) per step (`fail_level`), however often it is looked at.

- error_rate: share of candidate attempts that failed (5xx, timeout, connection error, a
  stream cut after its first byte), counted before the retry on stable, against p0 =
  error_rate's max. A mixture sequential probability ratio test (mSPRT; H. Robbins, "Statistical
  methods related to the law of the iterated logarithm", Ann. Math. Statist. 41:1397-1409, 1970;
  R. Johari et al., "Peeking at A/B tests", KDD 2017; M. Lindon et al., "Rapid regression
  detection in software deployments through sequential testing", KDD 2022, for canaries): after
  k failures in n attempts, in arrival order,

      Lambda_n = integral_{p0}^{1} q^k (1-q)^(n-k) pi(q) dq / (p0^k (1-p0)^(n-k)),

  pi = the uniform density on (p0, 1] (a Beta(1, 1) truncated to the alternative), so
      Lambda_n = B(k+1, n-k+1) * P(Beta(k+1, n-k+1) > p0) / ((1-p0) * p0^k * (1-p0)^(n-k)).
  For a true rate p <= p0 each factor's mean is p q/p0 + (1-p)(1-q)/(1-p0) <= 1 (q > p0), so
  Lambda is a nonnegative supermartingale with Lambda_0 = 1, and Ville's inequality gives
  P(sup_n Lambda_n >= 1/level) <= level: the always-valid p-value p_n = min(1, 1/max_{m<=n}
  Lambda_m) may be read after every request. FAIL when p_n <= fail_level.
- shadow_agreement: share of sampled greedy candidate answers equal to the fp16 build's on
  the first policy.shadow_compare_words words: the same test on disagreements, p0 = 1 -
  shadow_agreement's min. Where the gateway names m > 1 teams (shadow_check), half the level
  for the whole sample and half shared by the m teams, each tested on its own samples (FAIL only).
- ttft_p95_ratio / tpot_p95_ratio: p95(candidate) / p95(stable) over successful streaming
  attempts (p95: numpy.percentile, linear interpolation, Hyndman & Fan type 7). Test: Mann-Whitney
  U of H1: candidate latencies are stochastically greater than threshold x stable's (H. B. Mann &
  D. R. Whitney, Ann. Math. Statist. 18:50-60, 1947; scipy.stats.mannwhitneyu,
  alternative="greater"; exact for small samples without ties, normal approximation with tie
  correction otherwise). Not always-valid, so the level is split again over the most looks a
  step allows (alpha spending, Bonferroni): fail_level / ceil(max_step_s / check_interval_s).
  The test, not the point p95 ratio, decides a PASS: the p95 of the 20-40 candidate streams a
  step gets at low traffic is its 2nd- or 3rd-largest value, whose quantile level is spread like
  a Beta(h, n + 1 - h) order statistic, h = 0.95 (n - 1) + 1 (at n = 29: mean p92, sd 5
  points), so on a busy CPU a build as fast as stable can read above 1.5x (3.37 measured) and
  hold a step past its planned end (canary/README.md). The test uses every stream.
  What it does not see: a candidate whose bulk is fast and whose tail alone is slow; an
  absolute p99 SLO catches that.

- vllm_requests_waiting / vllm_kv_cache_usage: the candidate vLLM server's own gauges
  (canary/engine.py), one scrape per look. Not a statistical test, so outside alpha: FAIL when
  the gauge stayed above its max at each of the last policy.gauge_looks looks (a sustained queue
  or a full KV cache, not a burst); PASS with gauge_looks scrapes otherwise.

Verdict of a check: FAIL when the test rejects at its level (at any sample size: the guarantee
holds at every n; for latency also the ratio beyond the threshold). PASS with at least
policy.min_samples samples (per role for latency) and a result a build exactly at the
threshold shows half the time or better: for a binomial check, a count of failures
(disagreements) with P(X >= k | n, p0) >= 1/2, so that one error in 90 requests does not hold a
step whose 1 % threshold 90 requests cannot resolve; for latency, a Mann-Whitney p >= 1/2 (p is
about uniform for a candidate at exactly threshold x stable). Else INCONCLUSIVE
(more data may decide). PASS means "no evidence of harm at min_samples", not proof that the
threshold is met: proving an error rate below 1 % takes about 300 clean requests
(0.99^n <= 0.05). What min_samples buys in power is in canary/README.md and
benchmarks/canary_sim.py. A step: any FAIL -> FAIL, else any INCONCLUSIVE -> INCONCLUSIVE, else PASS.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy import special, stats

from canary.engine import EngineSample
from canary.policy import STATISTICAL, CanaryPolicy
from gateway.metrics import Sample, ShadowSample
from quantgate.stats import Verdict


@dataclass(frozen=True)
class Check:
    """One check of one step. value None = no data; p_value None = not tested (no data, or a
    vLLM gauge, which has no test);
    n = candidate samples (latency text also gives stable's)."""

    name: str
    value: float | None
    threshold: float
    p_value: float | None
    n: int
    verdict: Verdict
    text: str  # one line: "shadow_agreement 0.11 < 0.40 (n=37, p=0.0012) FAIL"


@dataclass(frozen=True)
class StepResult:
    verdict: Verdict
    checks: tuple[Check, ...]


def statistical_checks(policy: CanaryPolicy) -> int:
    """How many listed checks share policy.alpha (at least 1: error_rate is always listed)."""
    return sum(c.name in STATISTICAL for c in policy.checks)


def fail_level(policy: CanaryPolicy) -> float:
    """The level of a binomial check in one step: alpha / (statistical checks x steps), for any
    number of looks."""
    return policy.alpha / (statistical_checks(policy) * len(policy.steps))


def looks_per_step(policy: CanaryPolicy) -> int:
    """The most looks a step can have: ceil(max_step_s / check_interval_s)."""
    return max(1, math.ceil(policy.max_step_s / policy.check_interval_s - 1e-9))


def latency_level(policy: CanaryPolicy) -> float:
    """The level of one latency test at one look: fail_level / looks_per_step (Bonferroni)."""
    return fail_level(policy) / looks_per_step(policy)


def mixture_log_lr(k, n, p0: float):
    """log Lambda_n of the module docstring (uniform mixture over (p0, 1] against p0) after k
    events in n trials; numpy arrays or numbers. +inf when p0 = 0 and k > 0."""
    k, n = np.asarray(k, dtype=float), np.asarray(n, dtype=float)
    a, b = k + 1, n - k + 1
    with np.errstate(divide="ignore"):
        tail = np.log(special.betaincc(a, b, p0))  # P(Beta(a, b) > p0); -inf when it underflows
        return special.betaln(a, b) + tail - math.log1p(-p0) - special.xlogy(k, p0) - special.xlog1py(n - k, -p0)


def always_valid_p(events: Sequence[bool], p0: float) -> float:
    """min(1, 1 / max_m Lambda_m) over the prefixes of `events` (True = a failure or a
    disagreement, in arrival order) against rate p0; 1.0 for no events."""
    if not len(events):
        return 1.0
    k = np.cumsum(np.asarray(events, dtype=float))
    log_lr = mixture_log_lr(k, np.arange(1, len(k) + 1), p0)
    return float(min(1.0, math.exp(-max(0.0, float(np.max(log_lr))))))


@dataclass(frozen=True)
class _Evidence:
    """What one check measured: its value (None = no data) against `threshold`, the test's p (None = not
    tested), n candidate samples, how n reads in the line (`n_text`), the value's format (`fmt`)."""

    name: str
    value: float | None
    threshold: float
    p: float | None
    n: int
    n_text: str
    fmt: str


def _judge(ev: _Evidence, higher_is_worse: bool, level: float, *, passes: bool, fail_within: bool = False) -> Check:
    """Apply the verdict rule of the module docstring and write the check's line. passes: the
    PASS condition (min_samples and the estimate within the threshold, or close enough);
    fail_within: a rejection FAILs even when the estimate is now within the threshold (a
    sequential test whose boundary was crossed at an earlier sample)."""
    name, value, threshold, p, n, n_text, fmt = ev.name, ev.value, ev.threshold, ev.p, ev.n, ev.n_text, ev.fmt
    if value is None:
        return Check(
            name, None, threshold, None, n, Verdict.INCONCLUSIVE, f"{name} - ({n_text}) {Verdict.INCONCLUSIVE.value}"
        )
    beyond = value > threshold if higher_is_worse else value < threshold
    if p is not None and p <= level and (beyond or fail_within):
        verdict = Verdict.FAIL
    elif passes:
        verdict = Verdict.PASS
    else:
        verdict = Verdict.INCONCLUSIVE
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


def _rate_check(
    name: str,
    bad: list[bool],
    threshold: float,
    policy: CanaryPolicy,
    higher_is_worse: bool,
    level: float | None = None,
    label: str | None = None,
) -> Check:
    """A binomial check from outcomes in arrival order (True = a failure / a disagreement): the
    share of failures at most `threshold`, or the share of agreements at least `threshold`.
    PASS with min_samples and a count of `bad` no larger than the boundary rate p0 gives half
    the time, P(X >= k | n, p0) >= 1/2 (so 1 failure in 69+ requests passes a 1 % threshold).
    `level`: the FAIL level, fail_level(policy) unless given; `label`: the name in the line, `name` unless given."""
    n, k = len(bad), sum(bad)
    enough = n >= policy.min_samples
    p0 = threshold if higher_is_worse else 1 - threshold  # the boundary rate of `bad`
    value = ((k if higher_is_worse else n - k) / n) if n else None
    n_text = f"n={n}" if enough else f"n={n} < min {policy.min_samples}"
    p = always_valid_p(bad, p0) if n else None
    typical = bool(n) and float(stats.binom.sf(k - 1, n, p0)) >= 0.5
    fmt = ".3f" if higher_is_worse else ".2f"
    ev = _Evidence(name, value, threshold, p, n, n_text, fmt)
    check = _judge(
        ev, higher_is_worse, fail_level(policy) if level is None else level, passes=enough and typical, fail_within=True
    )
    return check if label is None else replace(check, text=check.text.replace(name, label, 1))


def _bound(policy: CanaryPolicy, name: str) -> float:
    check = policy.check(name)
    if check is None:
        raise ValueError(f"the policy does not list {name}")
    return check.bound


def error_rate_check(samples: Iterable[Sample], policy: CanaryPolicy) -> Check:
    """Candidate failure rate against error_rate's max (mSPRT, always-valid p)."""
    failed = [not s.ok for s in samples if s.role == "candidate"]
    return _rate_check("error_rate", failed, _bound(policy, "error_rate"), policy, higher_is_worse=True)


def p95_ratio(candidate: Sequence[float], stable: Sequence[float]) -> float:
    """p95(candidate) / p95(stable); inf when stable's p95 is 0 and candidate's is not."""
    c, s = float(np.percentile(candidate, 95)), float(np.percentile(stable, 95))
    if s > 0:
        return c / s
    return 1.0 if c == 0 else float("inf")


def slower_p(candidate: Sequence[float], stable: Sequence[float], threshold: float) -> float:
    """One-sided Mann-Whitney U p-value of H1: candidate latencies are stochastically greater than
    threshold x stable's (scipy.stats.mannwhitneyu, alternative="greater"). Small: evidence the
    candidate is slower than the threshold allows; about uniform on (0, 1) for a candidate exactly
    at it, so p >= 1/2 is what such a build shows half the time."""
    return float(stats.mannwhitneyu(candidate, np.asarray(stable) * threshold, alternative="greater").pvalue)


def latency_check(samples: Iterable[Sample], policy: CanaryPolicy, metric: str) -> Check:
    """p95 ratio of `metric` ("ttft" or "tpot"), judged by slower_p: FAIL at p <= latency_level(policy)
    with the ratio beyond the threshold, PASS at p >= 1/2 with min_samples per role."""
    threshold = _bound(policy, f"{metric}_p95_ratio")
    values: dict[str, list[float]] = {"candidate": [], "stable": []}
    for s in samples:
        v = getattr(s, f"{metric}_s")
        if s.outcome == "ok" and v is not None and s.role in values:
            values[s.role].append(v)
    cand, stab = values["candidate"], values["stable"]
    enough = min(len(cand), len(stab)) >= policy.min_samples
    ratio = p95_ratio(cand, stab) if cand and stab else None
    p = slower_p(cand, stab, threshold) if cand and stab else None
    n_text = f"n={len(cand)}/{len(stab)}" + ("" if enough else f" < min {policy.min_samples}")
    passes = enough and p is not None and p >= 0.5
    ev = _Evidence(f"{metric}_p95_ratio", ratio, threshold, p, len(cand), n_text, ".2f")
    return _judge(ev, True, latency_level(policy), passes=passes)


def shadow_check(shadows: Iterable[ShadowSample], policy: CanaryPolicy, teams: int = 1) -> Check:
    """Agreement with the fp16 build against shadow_agreement's min (mSPRT on disagreements).

    `teams`: how many teams the gateway's shadow samples can name (gateway.router.Router.shadow_teams: the teams
    with their own rate limit, and "anonymous"), known before the step. With more than one, the check's level is
    split in halves (Bonferroni): one for all the samples, one shared evenly by the teams, each judged on its own
    samples. A build that disagrees with fp16 on one team's prompts then FAILs on that team's, named in the line,
    where the mix of teams agrees well enough (a step's traffic is not a fixed mix). A team's test only FAILs; PASS
    and INCONCLUSIVE are the whole sample's. With one, the whole sample at the whole level, as before."""
    shadows = list(shadows)
    threshold, level = _bound(policy, "shadow_agreement"), fail_level(policy)
    disagree = [not s.agree for s in shadows]
    if teams <= 1:
        return _rate_check("shadow_agreement", disagree, threshold, policy, higher_is_worse=False)
    per_team = level / 2 / max(teams, len({s.team for s in shadows}))  # more than announced: an older gateway
    for team in sorted({s.team for s in shadows}):
        mine = [not s.agree for s in shadows if s.team == team]
        check = _rate_check(
            "shadow_agreement", mine, threshold, policy, False, per_team, f"shadow_agreement of team {team}"
        )
        if check.verdict is Verdict.FAIL:
            return check
    return _rate_check("shadow_agreement", disagree, threshold, policy, higher_is_worse=False, level=level / 2)


def gauge_check(engine: Sequence[EngineSample], policy: CanaryPolicy, name: str) -> Check:
    """A vLLM gauge of the candidate (`vllm_requests_waiting` or `vllm_kv_cache_usage`) against
    its max: FAIL when above it at each of the last policy.gauge_looks scrapes, PASS with that
    many scrapes otherwise (module docstring). `value` is the lowest of those last scrapes, the
    level the gauge held; n = scrapes with the gauge."""
    threshold, k = _bound(policy, name), policy.gauge_looks
    field = {"vllm_requests_waiting": "waiting", "vllm_kv_cache_usage": "kv_usage"}[name]
    values = [v for v in (getattr(e, field) for e in engine) if v is not None]
    n = len(values)
    fmt = ".0f" if field == "waiting" else ".2f"
    if n < k:
        last = f"{values[-1]:{fmt}}" if values else "-"
        why = "no /metrics scrape of the candidate yet" if not values else f"n={n} < gauge_looks {k}"
        return Check(name, None, threshold, None, n, Verdict.INCONCLUSIVE, f"{name} {last} ({why}) INCONCLUSIVE")
    held = min(values[-k:])
    verdict = Verdict.FAIL if held > threshold else Verdict.PASS
    op = ">" if held > threshold else "<="
    text = f"{name} {held:{fmt}} {op} {threshold:{fmt}} (lowest of the last {k} looks, n={n}) {verdict.value}"
    return Check(name, held, threshold, None, n, verdict, text)


def combine(checks: Iterable[Check]) -> Verdict:
    """Any FAIL -> FAIL; else any INCONCLUSIVE -> INCONCLUSIVE; else PASS."""
    verdicts = {c.verdict for c in checks}
    if Verdict.FAIL in verdicts:
        return Verdict.FAIL
    return Verdict.INCONCLUSIVE if Verdict.INCONCLUSIVE in verdicts else Verdict.PASS


def analyze(
    samples: Sequence[Sample],
    shadows: Sequence[ShadowSample],
    policy: CanaryPolicy,
    engine: Sequence[EngineSample] = (),
    teams: int = 1,
) -> StepResult:
    """The listed checks of a step, in policy.checks' order, from its samples (e.g.
    router.samples_since(step_start)) and the candidate's vLLM scrapes of the step; `teams` as shadow_check's."""
    judge = {
        "error_rate": lambda: error_rate_check(samples, policy),
        "ttft_p95_ratio": lambda: latency_check(samples, policy, "ttft"),
        "tpot_p95_ratio": lambda: latency_check(samples, policy, "tpot"),
        "shadow_agreement": lambda: shadow_check(shadows, policy, teams),
        "vllm_requests_waiting": lambda: gauge_check(engine, policy, "vllm_requests_waiting"),
        "vllm_kv_cache_usage": lambda: gauge_check(engine, policy, "vllm_kv_cache_usage"),
    }
    checks = tuple(judge[c.name]() for c in policy.checks)
    return StepResult(combine(checks), checks)


def live_line(step: int, percent: float, check: Check) -> str:
    """`step 2 (25%): shadow_agreement 0.11 < 0.40 (n=37, p=0.0012) FAIL` (step counted from 1)."""
    return f"step {step} ({percent:g}%): {check.text}"
