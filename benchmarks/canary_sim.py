"""Whole canaries, simulated with the real decision code: how often does an identical build
abort (A/A), and how many looks and requests does it take to abort a broken one?

Each canary walks the policy's steps as canary/controller.py does: the steps of
canary.plan.plan() at the offered traffic, a look every check_interval_s with
canary.analysis.analyze() on the step's samples (stable's earlier streams as the reference
when the step has too few, as controller.step_samples), and controller.step_decision().
Requests arrive as a Poisson stream at `rps`; each streams with probability 0.5 (the load
generator alternates), goes to the candidate with the step's share, fails with the build's
error rate, and a streamed one has a TTFT and a TPOT drawn from a lognormal (TTFT median
0.2 s, sigma 0.4; TPOT median 0.1 s, sigma 0.2; the candidate's scaled by `slower`). A greedy
candidate request is shadowed with probability the router's shadow_fraction (fleet.router) and
agrees with the fp16 build with probability `agreement`. The candidate's vLLM gauges (vllm_requests_waiting,
vllm_kv_cache_usage) read as an idle server's at every look: they are thresholds, not tests,
and spend none of alpha. Seeded; about 3 minutes on 2 cores at the default 300 (results/canary_sim.json, wall_s):

    .venv/bin/python -m benchmarks.canary_sim [--canaries 300] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, replace

import numpy as np

from benchmarks.common import report
from canary.analysis import analyze, fail_level, latency_level
from canary.controller import step_decision
from canary.engine import EngineSample
from canary.plan import Traffic, plan
from canary.policy import CanaryPolicy, load_policy
from gateway.fleet import load_fleet_params
from gateway.metrics import Sample, ShadowSample
from quantgate.errors import run_main
from quantgate.stats import Verdict
from tests.policies import FAST, FAST_BOUNDS, FAST_ROUTER  # the e2e tests' canary, simulated here

STREAM_SHARE = 0.5
NO_VERDICT = "no verdict at max_step_s"
TTFT, TPOT = (math.log(0.2), 0.4), (math.log(0.1), 0.2)  # lognormal (log median, sigma)
TAIL_X = 3.0  # a stream in a tail (contention or a tail-only regression) is this much slower


@dataclass(frozen=True)
class Build:
    """The candidate as the simulation sees it (stable: error_rate of an A/A pair, no slowdown)."""

    error_rate: float = 0.002
    agreement: float = 0.9
    slower: float = 1.0  # candidate latencies = stable's x slower
    slow_tail: float = 0.0  # share of the candidate's streams TAIL_X slower (a tail-only regression)
    dies_after_s: float | None = None  # from the start of step 1: every candidate attempt fails


@dataclass(frozen=True)
class Scenario:
    name: str
    policy: CanaryPolicy
    rps: float
    build: Build
    stable_error_rate: float = 0.002
    contention: float = 0.0  # share of every build's streams TAIL_X slower (cores shared with other work)
    share: float = 0.3  # of --canaries simulated for this scenario (A/A: all)
    shadow_fraction: float = 0.5  # the router's (params.yaml fleet.router.shadow_fraction)


@dataclass(frozen=True)
class Run:
    promoted: bool
    step: int
    reason: str  # the FAILed checks, or "max_step_s"/"end"
    looks: int
    candidate_requests: int
    seconds: float


def _requests(rng, sc: Scenario, horizon: float, share: float, t_off: float):
    """(samples, shadows) of one step at `share` of traffic over `horizon` s (times from the step's
    start; `t_off`: the step's start in the canary)."""
    rps, build, stable_err = sc.rps, sc.build, sc.stable_error_rate
    n = rng.poisson(rps * horizon)
    t = np.sort(rng.uniform(0, horizon, n))
    cand = rng.random(n) < share
    stream = rng.random(n) < STREAM_SHARE
    fail = rng.random(n) < np.where(cand, build.error_rate, stable_err)
    if build.dies_after_s is not None:
        fail |= cand & (t + t_off >= build.dies_after_s)
    scale = np.where(cand, build.slower, 1.0)
    scale *= np.where(rng.random(n) < np.where(cand, build.slow_tail, 0.0), TAIL_X, 1.0)
    scale *= np.where(rng.random(n) < sc.contention, TAIL_X, 1.0)
    ttft = np.exp(rng.normal(TTFT[0], TTFT[1], n)) * scale
    tpot = np.exp(rng.normal(TPOT[0], TPOT[1], n)) * scale
    shadowed = cand & ~fail & (rng.random(n) < sc.shadow_fraction)
    agree = rng.random(n) < build.agreement
    samples, shadows = [], []
    for i in range(n):
        role = "candidate" if cand[i] else "stable"
        ok, s = not fail[i], bool(stream[i])
        samples.append(
            Sample(
                t=float(t[i]),
                role=role,
                label=role,
                ok=ok,
                status=200 if ok else 500,
                ttft_s=float(ttft[i]) if ok and s else None,
                tpot_s=float(tpot[i]) if ok and s else None,
                retried=False,
                total_s=1.0,
                stream=s,
                outcome="ok" if ok else "server_error",
            )
        )
        if shadowed[i]:
            shadows.append(ShadowSample(t=float(t[i]), agree=bool(agree[i]), candidate="c", shadow="f"))
    return samples, shadows


def simulate(sc: Scenario, rng) -> Run:
    """One canary of `sc` (given traffic: no measuring phase)."""
    policy = sc.policy
    steps = plan(policy, Traffic(sc.rps, STREAM_SHARE, 1.0, "simulated", sc.shadow_fraction))
    earlier_stable: list[Sample] = []
    looks = cand_requests = 0
    clock = 0.0
    for step in steps:
        samples, shadows = _requests(rng, sc, policy.max_step_s + policy.check_interval_s, step.percent / 100, clock)
        times = np.array([s.t for s in samples])
        shadow_times = np.array([s.t for s in shadows])
        # the candidate's vLLM gauges, one scrape per look: an idle server (no queue, little KV
        # in use) at these rates; the gauge checks then PASS after gauge_looks looks
        looks_max = int(policy.max_step_s / policy.check_interval_s) + 2
        idle = [EngineSample(clock + (n + 1) * policy.check_interval_s, "c", 0.0, 0.02) for n in range(looks_max)]
        k = 0
        while True:
            k += 1
            elapsed = k * policy.check_interval_s
            i, j = int(np.searchsorted(times, elapsed, "right")), int(np.searchsorted(shadow_times, elapsed, "right"))
            now = samples[:i]
            if sum(s.role == "stable" and s.ttft_s is not None for s in now) < policy.min_samples:
                now = now + earlier_stable
            result = analyze(now, shadows[:j], policy, idle[:k])
            looks += 1
            decision = step_decision(result.verdict, elapsed, step, policy)
            if decision == "hold":
                continue
            cand_requests += sum(s.role == "candidate" for s in samples[:i])
            clock += elapsed
            if decision == "fail":
                failed = ",".join(c.name for c in result.checks if c.verdict is Verdict.FAIL)
                return Run(False, step.step, failed, looks, cand_requests, clock)
            if decision == "end":
                return Run(False, step.step, NO_VERDICT, looks, cand_requests, clock)
            earlier_stable += [s for s in samples[:i] if s.role == "stable"]
            break
    return Run(True, len(steps), "", looks, cand_requests, clock)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion k/n (95 %)."""
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def scenarios(base: CanaryPolicy, shadowed: float) -> list[Scenario]:
    """The simulated canaries: `base` the params.yaml policy, `shadowed` its router's shadow_fraction."""
    fast = base.model_copy(update=FAST).with_bounds(**FAST_BOUNDS)
    err, agree = base.check("error_rate").bound, base.check("shadow_agreement").bound
    at_limit = Build(error_rate=err, agreement=agree, slower=1.5)
    at_defaults = [
        Scenario("A/A, defaults, 1 rps (README example)", base, 1.0, Build(), share=1.0),
        Scenario("A/A, 10 % of every build's streams 3x (busy cores), 1 rps", base, 1.0, Build(), contention=0.1),
        Scenario("at every threshold, defaults, 1 rps", base, 1.0, at_limit, stable_error_rate=0.0, share=0.1),
        Scenario("broken: agreement 0.0 (the e2e broken build), defaults, 1 rps", base, 1.0, Build(agreement=0.0)),
        Scenario("broken: agreement 0.3, defaults, 1 rps", base, 1.0, Build(agreement=0.3)),
        Scenario("broken: agreement 0.3, defaults, 10 rps", base, 10.0, Build(agreement=0.3)),
        Scenario("2x slower TTFT/TPOT, defaults, 1 rps", base, 1.0, Build(slower=2.0)),
        Scenario("tail only: 10 % of candidate streams 3x, 1 rps", base, 1.0, Build(slow_tail=0.1)),
    ]
    e2e = [
        Scenario("e2e good: fast_policy, 1.5 rps, agreement 0.9", fast, 1.5, Build(error_rate=0, agreement=0.9)),
        Scenario("e2e broken: fast_policy, 1.5 rps, agreement 0.05", fast, 1.5, Build(error_rate=0, agreement=0.05)),
        Scenario("e2e killed: fast_policy, 1.5 rps, dies at 2 s", fast, 1.5, Build(error_rate=0, dies_after_s=2)),
    ]
    e2e_shadowed = FAST_ROUTER["shadow_fraction"]
    return [replace(sc, shadow_fraction=shadowed) for sc in at_defaults] + [
        replace(sc, shadow_fraction=e2e_shadowed) for sc in e2e
    ]


def pct(values, q) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def at_least_1(text: str) -> int:
    """argparse type of --canaries: a whole number >= 1 (0 or less ran 20 per scenario and recorded the number)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of canaries >= 1, e.g. 300")
    return value


def main() -> None:
    ap = argparse.ArgumentParser(prog="benchmarks.canary_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--canaries",
        type=at_least_1,
        default=300,
        help="A/A canaries simulated (default 300); other scenarios: a share of them, at least 20 each",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the simulated traffic (default 0)")
    args = ap.parse_args()
    base, shadowed = load_policy(), load_fleet_params().router.shadow_fraction
    rows, started = [], time.monotonic()
    for n_sc, sc in enumerate(scenarios(base, shadowed)):
        rng = np.random.default_rng([args.seed, n_sc])
        runs = [simulate(sc, rng) for _ in range(max(20, round(args.canaries * sc.share)))]
        aborted = [r for r in runs if not r.promoted]
        failed = [r for r in aborted if r.reason != NO_VERDICT]
        lo, hi = wilson(len(aborted), len(runs))
        reasons = {}
        for r in aborted:
            reasons[r.reason] = reasons.get(r.reason, 0) + 1
        rows.append(
            {
                "scenario": sc.name,
                "canaries": len(runs),
                "aborted %": round(100 * len(aborted) / len(runs), 1),
                "95% CI": f"[{100 * lo:.1f}, {100 * hi:.1f}]",
                "on a FAIL %": round(100 * len(failed) / len(runs), 1),
                "looks to abort (median / p90)": (
                    f"{pct([r.looks for r in aborted], 50):.0f} / {pct([r.looks for r in aborted], 90):.0f}"
                    if aborted
                    else "-"
                ),
                "candidate requests to abort (median / p90)": (
                    f"{pct([r.candidate_requests for r in aborted], 50):.0f} / "
                    f"{pct([r.candidate_requests for r in aborted], 90):.0f}"
                    if aborted
                    else "-"
                ),
                "abort step (median)": f"{pct([r.step for r in aborted], 50):.0f}" if aborted else "-",
                "minutes (median / p90)": f"{pct([r.seconds for r in runs], 50) / 60:.1f} / "
                f"{pct([r.seconds for r in runs], 90) / 60:.1f}",
                "abort reasons": ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) or "-",
            }
        )
    steps = plan(base, Traffic(1.0, STREAM_SHARE, 1.0, "--load-rps", shadowed))
    report(
        "canary_sim",
        "Whole canaries simulated with canary/analysis.py and the controller's decisions",
        rows,
        meta={
            "canaries_per_scenario": args.canaries,
            "seed": args.seed,
            "policy": base.model_dump(exclude={"router", "servers"}),
            "fail_level_binomial": fail_level(base),
            "fail_level_latency_per_look": latency_level(base),
            "planned_s_at_1_rps": [s.seconds for s in steps],
            "wall_s": round(time.monotonic() - started, 1),
            "latency": "lognormal: TTFT median 0.2 s sigma 0.4, TPOT median 0.1 s sigma 0.2; tails 3x",
            "stream_share": STREAM_SHARE,
            "shadow_fraction": shadowed,
        },
        notes=[
            f"alpha {base.alpha}: a binomial check FAILs at always-valid p <= {fail_level(base):.2g}, "
            f"a latency look at p <= {latency_level(base):.2g}",
            "A/A: same error rate (0.2 %) and latency, shadow agreement 0.9; at every threshold: error rate 1 %, "
            f"agreement {base.check('shadow_agreement').bound}, latencies 1.5x stable's (the null hypotheses at their "
            "boundary)",
        ],
    )


if __name__ == "__main__":
    run_main(main)
