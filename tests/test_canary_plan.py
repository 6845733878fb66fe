"""The canary's sequential tests over many looks (seeded simulations), the plan from the traffic
(feasible, refused, the start line) and the controller's step decision."""

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from canary.analysis import always_valid_p, fail_level, mixture_log_lr, shadow_check
from canary.controller import step_decision
from canary.plan import SLACK, StepPlan, Traffic, measured_traffic, plan, plan_line, refusal, require_feasible
from canary.policy import CanaryPolicy, load_policy
from gateway.metrics import Sample, ShadowSample
from quantgate.errors import QuantgateError
from quantgate.stats import Verdict
from tests.policies import FAST, FAST_ROUTER, fast_policy

REPO = Path(__file__).resolve().parents[1]
README_EXAMPLE = Traffic(1.0, 0.5, 1.0, "--load-rps")  # `quantgate canary run MODEL 2 --load-rps 1`


# --- the mixture SPRT ---------------------------------------------------------------------
def crossed(rng, rate: float, p0: float, streams: int, n: int, level: float) -> np.ndarray:
    """For each of `streams` Bernoulli(rate) streams of length n: did sup_m Lambda_m reach 1/level?"""
    k = np.cumsum(rng.random((streams, n)) < rate, axis=1)
    log_lr = mixture_log_lr(k, np.arange(1, n + 1)[None, :], p0)
    return log_lr.max(axis=1) >= math.log(1 / level)


@pytest.mark.parametrize("p0", [0.01, 0.3, 0.5])  # max_error_rate; 1 - min_shadow_agreement (default, e2e)
def test_type_one_error_over_every_look_stays_below_level(p0):
    """A build exactly at the threshold, looked at after every one of 600 samples: the share of
    streams that ever FAIL stays <= the level (Ville's inequality), here 0.05."""
    hits = crossed(np.random.default_rng(16), p0, p0, streams=1000, n=600, level=0.05)
    assert hits.mean() <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / 1000)  # within 2 sd of the bound
    better = crossed(np.random.default_rng(17), p0 / 2, p0, streams=300, n=600, level=0.05)
    assert better.mean() <= 0.05  # a build better than the threshold (the composite null): the same bound


def test_lambda_is_one_before_any_sample_and_shrinks_for_a_good_stream():
    assert mixture_log_lr(0, 0, 0.3) == pytest.approx(0.0)
    assert mixture_log_lr(0, 300, 0.01) == pytest.approx(-math.log(301))  # Lambda = 1 / (n + 1) with no events
    assert always_valid_p([], 0.3) == 1.0 and always_valid_p([False] * 50, 0.3) == 1.0


def test_a_clearly_broken_stream_fails_within_a_bounded_number_of_samples():
    """Shadow agreement 0.05 (the e2e broken build measures 0.00) against the default min 0.4 at the
    default level: FAIL within 40 comparisons in >= 95 % of seeded streams, and every stream within 60;
    all 15 first comparisons disagreeing FAIL at the 15th."""
    policy, rng, needed = CanaryPolicy(), np.random.default_rng(3), []
    level, p0 = fail_level(policy), 1 - policy.check("shadow_agreement").bound
    for _ in range(200):
        disagree = rng.random(150) >= 0.05
        k = np.cumsum(disagree)
        log_lr = mixture_log_lr(k, np.arange(1, 151), p0)
        first = np.flatnonzero(log_lr >= math.log(1 / level))
        needed.append(first[0] + 1 if len(first) else math.inf)
    assert max(needed) <= 60 and np.percentile(needed, 95) <= 40
    none = [ShadowSample(t=0.0, agree=False, candidate="c", shadow="f")] * 15
    assert shadow_check(none, policy).verdict is Verdict.FAIL
    assert shadow_check(none[:14], policy).verdict is not Verdict.FAIL


def test_a_clearly_good_stream_passes_at_min_samples():
    good = [ShadowSample(t=0.0, agree=i % 10 != 0, candidate="c", shadow="f") for i in range(20)]  # 0.9
    c = shadow_check(good, CanaryPolicy())
    assert c.verdict is Verdict.PASS and c.p_value > fail_level(CanaryPolicy())  # one early disagreement: p 0.46


# --- the plan -----------------------------------------------------------------------------
def test_the_readme_example_is_feasible_with_the_defaults_and_says_how_long():
    policy = load_policy(REPO / "params.yaml")
    steps = require_feasible(policy, README_EXAMPLE)
    # step 1: 20 candidate streams at 1 req/s x 50 % streaming x 10 % = 400 s
    assert [s.seconds for s in steps] == [400, 160, 80, policy.min_step_s]
    assert steps[0].limiting == "latency (candidate streams)" and steps[-1].limiting == "min_step_s"
    assert sum(s.seconds for s in steps) <= 30 * 60 and all(s.end_s <= policy.max_step_s for s in steps)
    line = plan_line(policy, README_EXAMPLE, steps)
    assert line.startswith("canary: at 1 req/s (--load-rps; 50% streaming, 100% greedy) this plan needs about 12 min")
    assert "step 1 (10%): 400 s, step 2 (25%): 160 s" in line and "p <= 0.0031" in line


def test_the_old_defaults_are_refused_with_the_params_to_change():
    old = CanaryPolicy(steps=[5, 25, 50, 100])
    at_old_share = dataclasses.replace(README_EXAMPLE, shadow_fraction=0.2)  # fleet.router's, then canary's
    steps = plan(old, at_old_share)
    assert steps[0].seconds == pytest.approx(20 / (1.0 * 0.2 * 0.05))  # 2000 s of shadow comparisons
    with pytest.raises(QuantgateError) as exc:
        require_feasible(old, at_old_share)
    assert str(exc.value) == (
        "canary plan cannot finish: at 1 req/s (--load-rps) step 1 (5%) needs about 2000 s for min_samples=20 of "
        "shadow_agreement, over max_step_s=900 / 1.5; change fleet.router.shadow_fraction, canary.steps, "
        "canary.min_samples or canary.max_step_s, or send more traffic"
    )
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize(
    "policy,shadowed,fix",
    [
        (CanaryPolicy(steps=[100]), 0.5, "canary.steps (a lower share first)"),  # stable never gets a stream
        (CanaryPolicy(), 0.0, "fleet.router.shadow_fraction"),
        (CanaryPolicy(min_step_s=700, max_step_s=900), 0.5, "canary.min_step_s or canary.max_step_s"),
    ],
)
def test_plans_that_cannot_finish_name_the_fix(policy, shadowed, fix):
    traffic = dataclasses.replace(README_EXAMPLE, shadow_fraction=shadowed)
    why = refusal(policy, traffic, plan(policy, traffic))
    assert why is not None and fix in why and why.startswith("canary plan cannot finish: at 1 req/s")


def test_more_traffic_shortens_the_plan_and_min_step_s_is_the_floor():
    steps = plan(CanaryPolicy(), Traffic(100.0))
    assert all(s.seconds == 60 and s.limiting == "min_step_s" for s in steps)
    assert refusal(CanaryPolicy(), Traffic(0.6), plan(CanaryPolicy(), Traffic(0.6))) is not None  # 667 s x 1.5


def test_a_short_plan_is_said_in_seconds_and_load_rps_is_not_told_to_stream_more():
    """A 40 s plan read "about 0 min"; --load-rps fixes the streaming share, yet its refusal said to stream more."""
    quick = CanaryPolicy(
        steps=[50, 100], min_step_s=3, max_step_s=60, check_interval_s=1, stale_after_s=10, min_samples=5
    )
    steps = require_feasible(quick, Traffic(10.0, source="--load-rps"))
    assert "this plan needs about 6 s (step 1 (50%): 3 s, step 2 (100%): 3 s)" in plan_line(quick, Traffic(10.0), steps)
    slow = Traffic(0.01, source="--load-rps")
    why = refusal(quick, slow, plan(quick, slow))
    assert why is not None and "latency (candidate streams)" in why and "stream more" not in why, why
    measured = Traffic(0.01, source="measured")
    assert "(or stream more requests)" in refusal(quick, measured, plan(quick, measured))


def test_the_e2e_fast_policy_is_feasible_at_its_load():
    fast = load_policy(REPO / "params.yaml").model_copy(update=FAST)  # tests/policies.py fast_policy()
    steps = require_feasible(fast, Traffic(1.5, shadow_fraction=FAST_ROUTER["shadow_fraction"]))
    assert steps[0].seconds == pytest.approx(2 / (1.5 * 0.5 * 0.1)) and steps[0].end_s < 240


def sample(role="stable", stream=True, retried=False):
    return Sample(0.0, role, role, True, 200, None, None, retried, 1.0, stream, "ok")


def test_measured_traffic_counts_first_attempts_and_their_streaming_share():
    samples = [sample(stream=i % 4 == 0) for i in range(60)] + [sample(retried=True)] * 5 + [sample("shadow")] * 9
    t = measured_traffic(samples, 30.0)
    assert (t.rps, t.stream_share, t.greedy_share) == (2.0, 0.25, 1.0) and t.source == "measured over 30 s"
    with pytest.raises(QuantgateError, match=r"no requests reached the router in 30 s \(canary.measure_s\)"):
        measured_traffic([sample("shadow")], 30.0)


# --- the step decision --------------------------------------------------------------------
STEP = StepPlan(1, 10.0, 400.0, "latency (candidate streams)")


@pytest.mark.parametrize(
    "verdict,elapsed,inconclusive,expected",
    [
        (Verdict.FAIL, 5, "hold", "fail"),  # one FAIL aborts: no failure_limit
        (Verdict.PASS, 30, "hold", "hold"),  # before min_step_s (60)
        (Verdict.PASS, 60, "hold", "pass"),
        (Verdict.INCONCLUSIVE, 400 * SLACK, "hold", "hold"),
        (Verdict.INCONCLUSIVE, 400 * SLACK, "abort", "end"),  # the step's planned end
        (Verdict.INCONCLUSIVE, 599, "abort", "hold"),
        (Verdict.INCONCLUSIVE, 900, "hold", "end"),  # max_step_s
    ],
)
def test_step_decision(verdict, elapsed, inconclusive, expected):
    assert step_decision(verdict, elapsed, STEP, CanaryPolicy(inconclusive=inconclusive)) == expected


def test_a_plan_waits_only_for_the_checks_the_policy_lists():
    only_errors = CanaryPolicy.model_validate({"checks": [{"name": "error_rate", "max": 0.05}], "min_step_s": 1})
    steps = plan(only_errors, Traffic(2.0, stream_share=0.5))  # no latency, no shadow: error_rate's samples
    assert steps[0].limiting == "error_rate" and steps[0].seconds == pytest.approx(20 / (2.0 * 0.10))
    gauges = CanaryPolicy.model_validate(
        {
            "checks": [{"name": "error_rate", "max": 0.05}, {"name": "vllm_kv_cache_usage", "max": 0.9}],
            "min_step_s": 1,
            "gauge_looks": 30,
            "check_interval_s": 5,
        }
    )
    last = plan(gauges, Traffic(100.0))[-1]  # at 100 req/s the samples come at once; 30 looks take 150 s
    assert last.limiting == "vLLM gauges (gauge_looks)" and last.seconds == 150
    assert "canary.gauge_looks" in refusal(gauges.model_copy(update={"max_step_s": 200}), Traffic(100.0), [last])


def test_a_last_step_at_100_after_50_has_its_stable_reference_from_step_one():
    # at 50 % the first step collects exactly min_samples stable streams in expectation (1.9999999 by float
    # rounding at some rates): the 100 % step must not be planned as never getting a sample
    from canary.plan import Traffic, plan, refusal

    policy = fast_policy(steps=[50, 100])
    for n in range(4, 60):  # requests seen in a 6 s measurement, as the e2e canary measures them
        for share in (0.2, 0.35, 0.5, 0.65, 0.8):
            traffic = Traffic(n / 6.00495, share, 1.0, "measured", shadow_fraction=0.5)
            steps = plan(policy, traffic)
            assert steps[1].seconds < float("inf"), (n, share, refusal(policy, traffic, steps))
