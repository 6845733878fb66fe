"""Canary step analysis (known-answer statistics, boundaries, live lines) and the canary policy."""

import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats

from canary.analysis import (
    Check,
    analyze,
    combine,
    error_rate_check,
    fail_level,
    gauge_check,
    latency_check,
    latency_level,
    live_line,
    p95_ratio,
    shadow_check,
)
from canary.engine import EngineSample, parse
from canary.policy import CanaryPolicy, load_policy, load_topology
from gateway.fleet import ServerOverride, load_fleet_params, serve_params
from gateway.metrics import Sample, ShadowSample
from quantgate.errors import QuantgateError
from quantgate.serving import ServeParams
from quantgate.stats import Verdict
from tests.test_canary_router import vllm_exposition

REPO = Path(__file__).resolve().parents[1]
POLICY = CanaryPolicy()  # min_samples 20, alpha 0.05, max_error_rate 0.01, ratios 1.5, agreement 0.4
AT_07 = POLICY.with_bounds(shadow_agreement=0.7)  # the shadow test's arithmetic at a bound of 0.7
LEVEL = 0.05 / (4 * 4)  # fail_level: alpha over 4 checks x 4 steps


def sample(role="candidate", ok=True, ttft=None, tpot=None):
    return Sample(
        t=0.0,
        role=role,
        label=role,
        ok=ok,
        status=200 if ok else 500,
        ttft_s=ttft,
        tpot_s=tpot,
        retried=False,
        total_s=1.0,
        stream=ttft is not None,
        outcome="ok" if ok else "server_error",
    )


def errors(k, n, role="candidate"):
    return [sample(role, ok=i >= k) for i in range(n)]


def binom_lower_tail(k, n, p):
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(0, k + 1))


def mixture_lr(k, n, p0):
    """Lambda_n by hand: integral_{p0}^1 q^k (1-q)^(n-k) dq / (1-p0) / (p0^k (1-p0)^(n-k)), with
    integral_{p0}^1 q^k (1-q)^(n-k) dq = k! (n-k)! / (n+1)! * P(Bin(n+1, p0) <= k)."""
    integral = math.factorial(k) * math.factorial(n - k) / math.factorial(n + 1) * binom_lower_tail(k, n + 1, p0)
    return integral / (1 - p0) / (p0**k * (1 - p0) ** (n - k))


def always_valid(bad, p0):
    """min(1, 1 / max over prefixes of Lambda), by hand."""
    k, best = 0, 0.0
    for n, b in enumerate(bad, 1):
        k += b
        best = max(best, mixture_lr(k, n, p0))
    return min(1.0, 1 / best)


# --- error rate: mixture SPRT (always-valid p) ----------------------------------------------
def test_error_rate_fail_matches_hand_computed_mixture_likelihood_ratio():
    c = error_rate_check(errors(3, 20) + errors(5, 50, role="stable"), POLICY)  # stable samples are ignored
    # the 3 failures come first: the largest Lambda is after them, 1/4 * P(Bin(4, .01) <= 3) / (0.99 * 0.01^3)
    expected = always_valid([True] * 3 + [False] * 17, 0.01)
    assert expected == pytest.approx(0.99e-6 / (0.25 * (1 - 0.01**4)), rel=1e-9)
    assert c.p_value == pytest.approx(expected, rel=1e-9) and expected <= LEVEL
    assert (c.value, c.n, c.verdict) == (0.15, 20, Verdict.FAIL)
    assert c.text == f"error_rate 0.150 > 0.010 (n=20, p={expected:.2g}) FAIL"


def test_error_rate_above_threshold_but_not_significant_is_inconclusive():
    c = error_rate_check(errors(1, 20), POLICY)
    assert c.p_value == pytest.approx(0.01 * 0.99 / 0.5 / (1 - 0.01**2))  # 1/Lambda_1: 0.0198
    assert c.verdict is Verdict.INCONCLUSIVE and c.value == 0.05
    assert LEVEL < c.p_value  # one failure in 20 is not evidence at the canary's level


def test_error_rate_at_threshold_passes_and_zero_errors_have_p_one():
    at = error_rate_check(errors(1, 20), CanaryPolicy().with_bounds(error_rate=0.05))
    assert at.value == 0.05 and at.verdict is Verdict.PASS and "0.050 <= 0.050" in at.text
    zero = error_rate_check(errors(0, 20), POLICY)
    assert zero.p_value == 1.0 and zero.verdict is Verdict.PASS


def test_one_error_passes_a_threshold_the_sample_cannot_resolve():
    # 1 failure in 90: 1.1 % > 1 %, but a build exactly at 1 % shows >= 1 failure in 90 with P = 0.60
    late = error_rate_check(errors(0, 89) + errors(1, 1), POLICY)
    assert late.value == pytest.approx(1 / 90) and late.verdict is Verdict.PASS and "0.011 > 0.010" in late.text
    early = error_rate_check(errors(1, 40), POLICY)  # P(X >= 1 | 40, 0.01) = 0.33: too many for 40
    assert early.verdict is Verdict.INCONCLUSIVE


def test_error_rate_too_few_samples_never_passes_but_overwhelming_evidence_fails():
    few = error_rate_check(errors(0, 5), POLICY)
    assert (
        few.verdict is Verdict.INCONCLUSIVE and few.text == "error_rate 0.000 <= 0.010 (n=5 < min 20, p=1) INCONCLUSIVE"
    )
    one = error_rate_check(errors(1, 1), POLICY)  # Lambda_1 = 50.5: not enough at the level 0.0031
    assert one.verdict is Verdict.INCONCLUSIVE and one.p_value == pytest.approx(1 / mixture_lr(1, 1, 0.01))
    dead = error_rate_check(errors(5, 5), POLICY)  # a dead server: valid at any n, no min_samples
    assert dead.verdict is Verdict.FAIL and dead.text.startswith("error_rate 1.000 > 0.010 (n=5 < min 20, p=")
    none = error_rate_check([], POLICY)
    assert none.value is None and none.text == "error_rate - (n=0 < min 20) INCONCLUSIVE"


# --- shadow agreement: the same test on disagreements ----------------------------------------
def shadows(k, n, agree_first=True):
    agree = [i < k for i in range(n)]
    return [ShadowSample(t=0.0, agree=a, candidate="v2", shadow="v1") for a in (agree if agree_first else agree[::-1])]


def test_a_build_that_drifts_on_one_teams_prompts_fails_on_that_team_where_the_mix_passes():
    agree = lambda team, k, n: [  # noqa: E731
        ShadowSample(t=0.0, agree=i < k, candidate="v2", shadow="v1", team=team) for i in range(n)
    ]
    mix = agree("billing", 30, 30) + agree("search", 30, 30) + agree("support", 0, 20)  # 60 of 80 agree
    whole = shadow_check(mix, POLICY)  # the gateway names no team: one sample
    assert whole.verdict is Verdict.PASS and whole.value == pytest.approx(0.75)
    c = shadow_check(mix, POLICY, teams=4)  # billing, search, support and anonymous
    expected = always_valid([True] * 20, 0.6)  # support's disagreements against 1 - 0.4
    assert c.verdict is Verdict.FAIL and c.value == 0.0 and c.n == 20
    assert c.p_value == pytest.approx(expected, rel=1e-9) and expected <= LEVEL / 2 / 4
    assert c.text == f"shadow_agreement of team support 0.00 < 0.40 (n=20, p={expected:.2g}) FAIL"
    # every team as good as the mix: the whole sample decides (at half the level)
    even = [s for team in ("billing", "search", "support") for s in agree(team, 20, 27)]
    split, one = shadow_check(even, POLICY, teams=4), shadow_check(even, POLICY)
    assert (split.verdict, split.value, split.n, split.text) == (Verdict.PASS, one.value, 81, one.text)
    # what the split costs: 15 disagreements in 15 would FAIL a team at the whole level, not at its eighth
    few = agree("billing", 30, 30) + agree("support", 0, 15)
    assert LEVEL / 2 / 4 < always_valid([True] * 15, 0.6) <= LEVEL
    assert shadow_check(few, POLICY, teams=4).verdict is not Verdict.FAIL


def test_shadow_agreement_fail_and_live_line():
    c = shadow_check(shadows(10, 37), AT_07)
    expected = always_valid([False] * 10 + [True] * 27, 0.3)  # disagreements against 1 - 0.7
    assert c.p_value == pytest.approx(expected, rel=1e-9) and expected < LEVEL
    assert c.verdict is Verdict.FAIL and c.value == pytest.approx(10 / 37)
    assert live_line(2, 25.0, c) == f"step 2 (25%): shadow_agreement 0.27 < 0.70 (n=37, p={expected:.2g}) FAIL"
    weaker = shadow_check(shadows(15, 37), AT_07)  # 0.41 of 37: p = 0.0037, just short of the level
    assert weaker.p_value == pytest.approx(always_valid([False] * 15 + [True] * 22, 0.3), rel=1e-9)
    assert weaker.verdict is Verdict.INCONCLUSIVE and LEVEL < weaker.p_value < 0.01


def test_shadow_fail_holds_once_the_boundary_was_crossed():
    # 12 disagreements first cross the boundary; 30 agreements afterwards do not undo it
    c = shadow_check(shadows(30, 42, agree_first=False), CanaryPolicy().with_bounds(shadow_agreement=0.5))
    assert c.value == pytest.approx(30 / 42) and c.verdict is Verdict.FAIL and "0.71 >= 0.50" in c.text


def test_shadow_agreement_boundary_and_pass():
    at = shadow_check(shadows(14, 20), AT_07)  # exactly 0.70
    assert at.verdict is Verdict.PASS and at.text.startswith("shadow_agreement 0.70 >= 0.70 (n=20")
    below = shadow_check(shadows(13, 20), AT_07)  # 0.65: P(X <= 13 | 20, 0.7) = 0.39 < 1/2, no evidence either
    assert below.p_value == pytest.approx(always_valid([False] * 13 + [True] * 7, 0.3), rel=1e-9)
    assert below.verdict is Verdict.INCONCLUSIVE and binom_lower_tail(13, 20, 0.7) < 0.5


def test_the_default_bound_passes_the_measured_good_builds_and_fails_a_broken_one():
    # measured live (README, canary/README.md): a broken build (embeddings permuted) agrees 0.00, int8 at
    # bfloat16 on AVX512 0.52 at n=23 before case/punctuation were ignored, int8 at float32 on AVX2 0.71
    assert POLICY.check("shadow_agreement").bound == 0.4
    assert shadow_check(shadows(12, 23), POLICY).verdict is Verdict.PASS  # 0.52
    assert shadow_check(shadows(0, 15), POLICY).verdict is Verdict.FAIL  # broken: 15 disagreements in a row
    assert shadow_check(shadows(0, 12), POLICY).verdict is Verdict.INCONCLUSIVE  # not yet at the level


# --- latency: p95 ratio + one-sided Mann-Whitney U -------------------------------------------
def latencies(cand, stab, metric="ttft"):
    return [sample("candidate", **{metric: v}) for v in cand] + [sample("stable", **{metric: v}) for v in stab]


def test_mann_whitney_clearly_separated_small_samples_exact_p():
    # 5 vs 5, every candidate value above every 1.5 x stable one: exact p = 1 / C(10, 5) = 1/252
    cand, stab = [10, 11, 12, 13, 14], [1, 2, 3, 4, 5]
    one_look = CanaryPolicy(min_samples=5, steps=[100], min_step_s=5, max_step_s=5, check_interval_s=5)  # 0.05 / 4
    c = latency_check(latencies(cand, stab), one_look, "ttft")
    assert c.p_value == pytest.approx(1 / 252)
    assert c.value == pytest.approx(p95_ratio(cand, stab)) == pytest.approx(13.8 / 4.8)
    assert c.verdict is Verdict.FAIL and c.text == "ttft_p95_ratio 2.88 > 1.50 (n=5/5, p=0.004) FAIL"
    # the default plan allows 4 steps x 180 looks: 1/252 is no evidence at 0.05 / 4 / 4 / 180
    many = latency_check(latencies(cand, stab), CanaryPolicy(min_samples=5), "ttft")
    assert many.p_value == pytest.approx(1 / 252) and many.verdict is Verdict.INCONCLUSIVE


def test_mann_whitney_tests_against_threshold_times_stable():
    # every candidate value is 2x a stable one: above stable, but only just above 1.5x it
    stab = [1.0 + i / 10 for i in range(30)]
    c = latency_check(latencies([2 * v for v in stab], stab), POLICY, "ttft")
    expected = stats.mannwhitneyu([2 * v for v in stab], [1.5 * v for v in stab], alternative="greater").pvalue
    assert c.value == pytest.approx(2.0) and c.p_value == pytest.approx(expected)


def test_identical_samples_pass():
    c = latency_check(latencies([0.2] * 25, [0.2] * 25, "tpot"), POLICY, "tpot")
    assert c.name == "tpot_p95_ratio" and c.value == 1.0 and c.verdict is Verdict.PASS
    assert c.p_value == pytest.approx(1.0)  # every candidate value below 1.5 x every stable one
    assert c.text == "tpot_p95_ratio 1.00 <= 1.50 (n=25/25, p=1) PASS"


def test_ratio_at_threshold_passes_even_when_significantly_slower():
    c = latency_check(latencies([3.0] * 20, [2.0] * 20), POLICY, "ttft")
    assert c.value == 1.5 and c.verdict is Verdict.PASS and c.p_value == 1.0  # all tied with 1.5 x stable
    assert stats.mannwhitneyu([3.0] * 20, [2.0] * 20, alternative="greater").pvalue < 1e-6  # slower than 1x


def test_a_noisy_p95_of_a_build_as_fast_as_stable_passes_on_the_test():
    """Same lognormal for both roles, a long tail (sigma 0.6): the candidate's p95 of 25 streams
    reads 1.63x stable's, above the 1.5 bound, but nothing says the candidate is slower."""
    rng = np.random.default_rng(27)
    stable = np.exp(rng.normal(np.log(0.04), 0.6, 250)).tolist()
    cand = np.exp(rng.normal(np.log(0.04), 0.6, 25)).tolist()
    c = latency_check(latencies(cand, stable, "tpot"), POLICY, "tpot")
    assert c.value == pytest.approx(p95_ratio(cand, stable)) and c.value > 1.5
    assert c.p_value == pytest.approx(stats.mannwhitneyu(cand, np.asarray(stable) * 1.5, alternative="greater").pvalue)
    assert c.p_value >= 0.5 and c.verdict is Verdict.PASS


def test_a_candidate_slower_than_the_threshold_in_bulk_does_not_pass():
    """Every candidate stream 1.6x a stable one: no PASS (p < 1/2), not yet a FAIL at 25 streams."""
    rng = np.random.default_rng(4)
    stable = np.exp(rng.normal(np.log(0.04), 0.2, 250))
    cand = 1.6 * np.exp(rng.normal(np.log(0.04), 0.2, 25))
    c = latency_check(latencies(cand.tolist(), stable.tolist(), "tpot"), POLICY, "tpot")
    assert c.p_value < 0.5 and c.verdict is Verdict.INCONCLUSIVE
    slower = latency_check(latencies((2.5 * cand).tolist(), stable.tolist(), "tpot"), POLICY, "tpot")
    assert slower.verdict is Verdict.FAIL and slower.p_value <= latency_level(POLICY)


def test_a_tail_alone_is_not_what_the_test_sees():
    """The documented limit (canary/analysis.py): 2 of 20 candidate streams 100x slower, the bulk
    the same. The p95 ratio says 5x, the rank test sees no shift, so the check PASSes; an
    absolute p99 SLO is what catches a tail alone."""
    stable = list(range(1, 21))
    cand = list(range(1, 19)) + [100, 100]
    c = latency_check(latencies(cand, stable), POLICY, "ttft")
    assert c.value > 1.5 and c.p_value > 0.5 and c.verdict is Verdict.PASS


def test_latency_uses_only_successful_samples_with_a_value_and_needs_both_roles():
    data = latencies([1.0] * 20, [1.0] * 20) + [
        sample("candidate", ok=False, ttft=50.0),
        sample("candidate", ttft=None),
        sample("shadow", ttft=50.0),
    ]
    assert latency_check(data, POLICY, "ttft").value == 1.0
    few = latency_check(latencies([1.0] * 20, [1.0] * 3), POLICY, "ttft")
    assert few.verdict is Verdict.INCONCLUSIVE and few.p_value == pytest.approx(1.0)
    assert "(n=20/3 < min 20, p=1)" in few.text
    # too few to PASS, tested for FAIL: exact p = 1 / C(23, 3), no evidence at 1.7e-05 per look
    slow = latency_check(latencies([9.0, 9.1, 9.2], [1.0 + i / 100 for i in range(20)]), POLICY, "ttft")
    assert slow.verdict is Verdict.INCONCLUSIVE and slow.p_value == pytest.approx(1 / math.comb(23, 3))
    assert "(n=3/20 < min 20, p=" in slow.text


# --- step verdict ---------------------------------------------------------------------------
def check(verdict):
    return Check("x", 0.0, 0.0, None, 0, verdict, "")


def test_combine_any_fail_then_any_inconclusive_then_pass():
    P, I, F = Verdict.PASS, Verdict.INCONCLUSIVE, Verdict.FAIL  # noqa: E741 - the verdicts' initials
    assert combine(map(check, [P, I, F])) is F
    assert combine(map(check, [P, I, P])) is I
    assert combine(map(check, [P, P, P])) is P


def test_analyze_a_healthy_step_passes():
    data = errors(0, 40) + errors(0, 40, role="stable")
    data += [sample(r, ttft=0.1 + i / 100, tpot=0.02) for r in ("candidate", "stable") for i in range(25)]
    result = analyze(data, shadows(20, 25), POLICY, engine(waiting=[0, 1, 0], kv=[0.1, 0.2, 0.1]))
    assert result.verdict is Verdict.PASS, [c.text for c in result.checks]
    assert [c.name for c in result.checks] == [
        "error_rate",
        "ttft_p95_ratio",
        "tpot_p95_ratio",
        "shadow_agreement",
        "vllm_requests_waiting",
        "vllm_kv_cache_usage",
    ]


def engine(waiting, kv):
    return [EngineSample(float(i), "v2", w, u) for i, (w, u) in enumerate(zip(waiting, kv, strict=True))]


def test_a_vllm_gauge_fails_only_when_held_above_its_max_for_gauge_looks_looks():
    policy = CanaryPolicy()  # waiting max 4, kv max 0.9, gauge_looks 3
    burst = gauge_check(engine([0, 9, 9, 3], [0.1] * 4), policy, "vllm_requests_waiting")
    assert burst.verdict is Verdict.PASS and burst.value == 3  # the lowest of the last 3 looks
    held = gauge_check(engine([0, 5, 6, 9], [0.1] * 4), policy, "vllm_requests_waiting")
    assert held.verdict is Verdict.FAIL and held.value == 5
    assert held.text == "vllm_requests_waiting 5 > 4 (lowest of the last 3 looks, n=4) FAIL"
    at = gauge_check(engine([0, 4, 4, 4], [0.1] * 4), policy, "vllm_requests_waiting")  # held at the max: not above
    assert at.verdict is Verdict.PASS
    assert at.text == "vllm_requests_waiting 4 <= 4 (lowest of the last 3 looks, n=4) PASS"
    full = gauge_check(engine([0] * 3, [0.95, 0.97, 0.99]), policy, "vllm_kv_cache_usage")
    assert full.verdict is Verdict.FAIL and full.value == pytest.approx(0.95)
    few = gauge_check(engine([9, 9], [0.1, 0.1]), policy, "vllm_requests_waiting")
    assert few.verdict is Verdict.INCONCLUSIVE and "n=2 < gauge_looks 3" in few.text
    none = gauge_check([EngineSample(0.0, "v2", None, None)], policy, "vllm_kv_cache_usage")
    assert none.verdict is Verdict.INCONCLUSIVE and "no /metrics scrape of the candidate yet" in none.text


def test_the_vllm_gauges_are_read_from_a_real_exposition():
    text = vllm_exposition(waiting=2, kv_usage=0.37)
    s = parse(text + text.replace('engine="0"', 'engine="1"'), "v2", 5.0)  # two engines: queues add up
    assert (s.waiting, s.kv_usage, s.t) == (4.0, 0.37, 5.0)
    assert parse("# nothing of vLLM here\n", "v2", 0.0).waiting is None


# --- policy ---------------------------------------------------------------------------------
def test_policy_defaults_load_from_params_yaml():
    p = load_policy(REPO / "params.yaml")
    assert p.steps == [10, 25, 50, 100] and p.inconclusive in ("abort", "hold")
    assert p.checks == CanaryPolicy().checks  # params.yaml lists the defaults
    assert load_topology(REPO / "params.yaml").servers.candidate.cpu_cores == "1"
    assert (
        0 < p.alpha < 0.5
        and p.min_samples >= 2
        and load_fleet_params(REPO / "params.yaml").router.shadow_compare_words >= 1
    )


def write_params(tmp_path, block="canary", **changes) -> Path:
    """A copy of params.yaml with block `block` changed: a__b=v sets block.a.b to v."""
    doc = yaml.safe_load((REPO / "params.yaml").read_text())
    for dotted, value in changes.items():
        *parents, key = dotted.split("__")
        target = doc[block]
        for p in parents:
            target = target[p]
        target[key] = value
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"steps": [50, 25]}, "canary.steps"),
        ({"steps": [5, 150]}, "canary.steps"),
        ({"steps": []}, "canary.steps"),
        ({"alpha": 0.7}, "canary.alpha"),
        ({"checks": [{"name": "error_rate", "max": -0.1}]}, "canary.checks.0"),
        ({"checks": [{"name": "error_rate", "min": 0.1}]}, "canary.checks.0"),
        ({"checks": [{"name": "latency", "max": 2}]}, "canary.checks.0.name"),
        ({"checks": [{"name": "ttft_p95_ratio", "max": 2}]}, "canary.checks"),
        ({"checks": [{"name": "error_rate", "max": 0.1}, {"name": "error_rate", "max": 0.2}]}, "canary.checks"),
        ({"checks": [{"name": "error_rate", "max": 0.1, "min": 0}]}, "canary.checks.0"),
        (
            {"checks": [{"name": "error_rate", "max": 0.1}, {"name": "vllm_kv_cache_usage", "max": 2}]},
            "canary.checks.1",
        ),
        ({"steps": [10, 50]}, "canary.steps"),
        ({"gauge_looks": 0}, "canary.gauge_looks"),
        ({"min_step_s": 300, "max_step_s": 120}, "canary.max_step_s"),
        ({"inconclusive": "maybe"}, "canary.inconclusive"),
        ({"bogus": 1}, "canary.bogus"),
        ({"measure_s": 0}, "canary.measure_s"),
    ],
)
def test_bad_policy_values_name_the_field(tmp_path, changes, field):
    with pytest.raises(QuantgateError) as exc:
        load_policy(write_params(tmp_path, **changes))
    assert re.search(rf"params.yaml:\d+: {re.escape(field)}: ", str(exc.value))  # file, line, field


@pytest.mark.parametrize("key", ["request_timeout_s", "connect_timeout_s", "shadow_fraction", "shadow_compare_words"])
def test_a_router_key_left_in_the_canary_block_names_its_new_place(tmp_path, key):
    with pytest.raises(QuantgateError) as exc:
        load_policy(write_params(tmp_path, **{key: 1}))
    assert f"canary.{key} moved to fleet.router.{key}" in str(exc.value) and "\n" not in str(exc.value)


def test_bad_router_values_name_the_field(tmp_path):
    with pytest.raises(QuantgateError) as exc:
        load_fleet_params(write_params(tmp_path, block="fleet", router__shadow_fraction=2))
    assert re.search(r"params.yaml:\d+: fleet.router.shadow_fraction: ", str(exc.value))


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"servers__stable__port": 70000}, "canary_topology.servers.stable.port"),
        ({"router__hots": "x"}, "canary_topology.router.hots"),
    ],
)
def test_bad_topology_values_name_the_field(tmp_path, changes, field):
    with pytest.raises(QuantgateError) as exc:
        load_topology(write_params(tmp_path, block="canary_topology", **changes))
    assert re.search(rf"params.yaml:\d+: {re.escape(field)}: ", str(exc.value))


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"servers__stable__port": 9000, "servers__candidate__port": 9000},
            "servers.candidate.port 9000 is also servers.stable.port",
        ),
        ({"router__port": 9001, "servers__shadow__port": 9001}, "router.port 9001 is also servers.shadow.port"),
        ({"router__port": 9002, "servers__candidate__port": 9002}, "router.port 9002 is also servers.candidate.port"),
    ],
)
def test_a_topology_whose_listeners_share_a_port_is_refused(tmp_path, changes, message):
    """load_topology took them; the second listener failed to bind mid-canary."""
    with pytest.raises(QuantgateError) as exc:
        load_topology(write_params(tmp_path, block="canary_topology", **changes))
    assert re.fullmatch(
        rf".*params.yaml:\d+: canary_topology: {message}; give each its own port, or 0 for a free one", str(exc.value)
    ), exc.value


def test_the_shadow_may_share_the_stable_servers_port_and_0_never_clashes(tmp_path):
    path = write_params(tmp_path, block="canary_topology", servers__stable__port=9000, servers__shadow__port=9000)
    assert load_topology(path).servers.shadow.port == 9000
    assert load_topology(write_params(tmp_path, block="canary_topology", router__port=0)).router.port == 0


@pytest.mark.parametrize(
    "key,value,says",
    [
        ("max_error_rate", 0.02, "is now an entry of canary.checks: `- {name: error_rate, max: 0.02}`"),
        ("min_shadow_agreement", 0.8, "`- {name: shadow_agreement, min: 0.8}`"),
        ("router", {"port": 0}, "canary.router moved to the block `canary_topology`"),
        ("servers", {}, "canary.servers moved to the block `canary_topology`"),
    ],
)
def test_keys_of_the_old_policy_say_where_they_went(tmp_path, key, value, says):
    with pytest.raises(QuantgateError, match=re.escape(says)):
        load_policy(write_params(tmp_path, **{key: value}))


@pytest.mark.parametrize("key", ["failure_limit", "min_requests_per_step"])
def test_removed_keys_say_why_and_what_to_do(tmp_path, key):
    with pytest.raises(QuantgateError, match=rf"canary.{key}: .*removed: .*; delete this key"):
        load_policy(write_params(tmp_path, **{key: 2}))


def test_missing_canary_block_is_named(tmp_path):
    (tmp_path / "params.yaml").write_text("gate: {seed: 0}\n")
    with pytest.raises(QuantgateError, match="no block 'canary'"):
        load_policy(tmp_path / "params.yaml")


def test_serve_params_applies_a_roles_port_and_appends_its_args():
    base = ServeParams(extra_args=["--enforce-eager"])
    p = serve_params(base, ServerOverride(port=9001, extra_args=["--max-num-seqs", "8"]))
    assert p.port == 9001 and p.extra_args == ["--enforce-eager", "--max-num-seqs", "8"]
    assert p.dtype == base.dtype and base.port == 0


def test_the_policy_is_its_list_of_checks_judged_in_that_order():
    policy = CanaryPolicy().with_bounds(error_rate=0.02, shadow_agreement=0.8)
    assert [c.name for c in policy.checks] == [c.name for c in analyze([], [], policy).checks]
    assert [str(c) for c in policy.checks] == [
        "error_rate <= 0.02",
        "ttft_p95_ratio <= 1.5",
        "tpot_p95_ratio <= 1.5",
        "0.8 <= shadow_agreement",
        "vllm_requests_waiting <= 4",
        "vllm_kv_cache_usage <= 0.9",
    ]
    assert fail_level(policy) == pytest.approx(0.05 / (4 * 4))  # gauges spend no alpha


def test_a_check_left_out_is_not_judged_and_alpha_is_split_over_the_rest():
    policy = CanaryPolicy.model_validate(
        {"checks": [{"name": "shadow_agreement", "min": 0.6}, {"name": "error_rate", "max": 0.05}]}
    )
    result = analyze(errors(0, 30), shadows(25, 30), policy)  # no latencies, no gauges: not asked for
    assert [c.name for c in result.checks] == ["shadow_agreement", "error_rate"]
    assert result.verdict is Verdict.PASS, [c.text for c in result.checks]
    assert fail_level(policy) == pytest.approx(0.05 / (2 * 4))
    with pytest.raises(ValueError, match="not listed in canary.checks: ttft_p95_ratio"):
        policy.with_bounds(ttft_p95_ratio=2)
