"""Canary step analysis (known-answer statistics, boundaries, live lines) and the canary policy."""

import math
import re
from pathlib import Path

import pytest
import yaml

from canary.analysis import Check, analyze, combine, error_rate_check, latency_check, live_line, p95_ratio, shadow_check
from canary.metrics import Sample, ShadowSample
from canary.policy import CanaryPolicy, ServerOverride, load_policy, serve_params
from quantgate.errors import QuantgateError
from quantgate.serving import ServeParams
from quantgate.stats import Verdict

REPO = Path(__file__).resolve().parents[1]
POLICY = CanaryPolicy()  # min_samples 20, alpha 0.05, max_error_rate 0.01, ratios 1.5, agreement 0.7


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


def binom_upper_tail(k, n, p):
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))


def binom_lower_tail(k, n, p):
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(0, k + 1))


# --- error rate: exact one-sided binomial -------------------------------------------------
def test_error_rate_fail_matches_hand_computed_binomial_tail():
    c = error_rate_check(errors(3, 20) + errors(5, 50, role="stable"), POLICY)  # stable samples are ignored
    # P(X >= 3 | n=20, p=0.01) = 1 - P(X <= 2)
    expected = 1 - (0.99**20 + 20 * 0.01 * 0.99**19 + 190 * 0.01**2 * 0.99**18)
    assert c.p_value == pytest.approx(expected, rel=1e-9) == pytest.approx(binom_upper_tail(3, 20, 0.01))
    assert (c.value, c.n, c.verdict) == (0.15, 20, Verdict.FAIL)
    assert c.text == f"error_rate 0.150 > 0.010 (n=20, p={expected:.2g}) FAIL"


def test_error_rate_above_threshold_but_not_significant_is_inconclusive():
    c = error_rate_check(errors(1, 20), POLICY)
    assert c.p_value == pytest.approx(1 - 0.99**20)  # 0.18
    assert c.verdict is Verdict.INCONCLUSIVE and c.value == 0.05


def test_error_rate_at_threshold_passes_and_zero_errors_have_p_one():
    at = error_rate_check(errors(1, 20), CanaryPolicy(max_error_rate=0.05))
    assert at.value == 0.05 and at.verdict is Verdict.PASS and "0.050 <= 0.050" in at.text
    zero = error_rate_check(errors(0, 20), POLICY)
    assert zero.p_value == 1.0 and zero.verdict is Verdict.PASS


def test_error_rate_too_few_samples_is_inconclusive_even_if_all_fail():
    c = error_rate_check(errors(5, 5), POLICY)
    assert c.verdict is Verdict.INCONCLUSIVE and c.p_value is None
    assert c.text == "error_rate 1.000 > 0.010 (n=5 < min 20) INCONCLUSIVE"
    none = error_rate_check([], POLICY)
    assert none.value is None and none.text == "error_rate - (n=0 < min 20) INCONCLUSIVE"


# --- shadow agreement: exact one-sided binomial --------------------------------------------
def shadows(k, n):
    return [ShadowSample(t=0.0, agree=i < k, candidate="v2", shadow="v1") for i in range(n)]


def test_shadow_agreement_fail_and_live_line():
    c = shadow_check(shadows(15, 37), POLICY)
    expected = binom_lower_tail(15, 37, 0.7)  # P(X <= 15 | n=37, p=0.7)
    assert c.p_value == pytest.approx(expected, rel=1e-9) and expected < 0.001
    assert c.verdict is Verdict.FAIL and c.value == pytest.approx(15 / 37)
    assert live_line(2, 25.0, c) == f"step 2 (25%): shadow_agreement 0.41 < 0.70 (n=37, p={expected:.2g}) FAIL"


def test_shadow_agreement_boundary_and_pass():
    at = shadow_check(shadows(14, 20), POLICY)  # exactly 0.70
    assert at.verdict is Verdict.PASS and at.text.startswith("shadow_agreement 0.70 >= 0.70 (n=20")
    below = shadow_check(shadows(13, 20), POLICY)  # 0.65, P(X <= 13 | 20, 0.7) = 0.39: not significant
    assert below.p_value == pytest.approx(binom_lower_tail(13, 20, 0.7)) and below.verdict is Verdict.INCONCLUSIVE


# --- latency: p95 ratio + one-sided Mann-Whitney U -------------------------------------------
def latencies(cand, stab, metric="ttft"):
    return [sample("candidate", **{metric: v}) for v in cand] + [sample("stable", **{metric: v}) for v in stab]


def test_mann_whitney_clearly_separated_small_samples_exact_p():
    # 5 vs 5, every candidate value above every stable one: exact p = 1 / C(10, 5) = 1/252
    c = latency_check(latencies([10, 11, 12, 13, 14], [1, 2, 3, 4, 5]), CanaryPolicy(min_samples=5), "ttft")
    assert c.p_value == pytest.approx(1 / 252)
    assert c.value == pytest.approx(p95_ratio([10, 11, 12, 13, 14], [1, 2, 3, 4, 5])) == pytest.approx(13.8 / 4.8)
    assert c.verdict is Verdict.FAIL and c.text == "ttft_p95_ratio 2.88 > 1.50 (n=5/5, p=0.004) FAIL"


def test_identical_samples_pass_with_p_one():
    c = latency_check(latencies([0.2] * 25, [0.2] * 25, "tpot"), POLICY, "tpot")
    assert c.name == "tpot_p95_ratio" and c.value == 1.0 and c.p_value == 1.0 and c.verdict is Verdict.PASS


def test_ratio_at_threshold_passes_even_when_significantly_slower():
    c = latency_check(latencies([3.0] * 20, [2.0] * 20), POLICY, "ttft")
    assert c.value == 1.5 and c.p_value < 1e-6 and c.verdict is Verdict.PASS


def test_high_ratio_from_an_outlier_without_significance_is_inconclusive():
    stable = list(range(1, 21))
    cand = list(range(1, 19)) + [100, 100]  # p95 ratio ~5, but the bulk is the same
    c = latency_check(latencies(cand, stable), POLICY, "ttft")
    assert c.value > 1.5 and c.p_value > 0.05 and c.verdict is Verdict.INCONCLUSIVE


def test_latency_uses_only_successful_samples_with_a_value_and_needs_both_roles():
    data = latencies([1.0] * 20, [1.0] * 20) + [
        sample("candidate", ok=False, ttft=50.0),
        sample("candidate", ttft=None),
        sample("shadow", ttft=50.0),
    ]
    assert latency_check(data, POLICY, "ttft").value == 1.0
    few = latency_check(latencies([1.0] * 20, [1.0] * 3), POLICY, "ttft")
    assert few.verdict is Verdict.INCONCLUSIVE and few.p_value is None and "(n=20/3 < min 20)" in few.text


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
    result = analyze(data, shadows(20, 25), POLICY)
    assert result.verdict is Verdict.PASS
    assert [c.name for c in result.checks] == ["error_rate", "ttft_p95_ratio", "tpot_p95_ratio", "shadow_agreement"]


# --- policy ---------------------------------------------------------------------------------
def test_policy_defaults_load_from_params_yaml():
    p = load_policy(REPO / "params.yaml")
    assert p.steps == [5, 25, 50, 100] and p.inconclusive in ("abort", "hold")
    assert 0 < p.alpha < 0.5 and p.min_samples >= 2 and p.shadow_compare_words >= 1


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
        ({"max_error_rate": -0.1}, "canary.max_error_rate"),
        ({"min_step_s": 300, "max_step_s": 120}, "canary.max_step_s"),
        ({"inconclusive": "maybe"}, "canary.inconclusive"),
        ({"shadow_fraction": 2}, "canary.shadow_fraction"),
        ({"bogus": 1}, "canary.bogus"),
        ({"servers__stable__port": 70000}, "canary.servers.stable.port"),
        ({"router__hots": "x"}, "canary.router.hots"),
    ],
)
def test_bad_policy_values_name_the_field(tmp_path, changes, field):
    with pytest.raises(QuantgateError) as exc:
        load_policy(write_params(tmp_path, **changes))
    assert re.search(rf"params.yaml:\d+: {re.escape(field)}: ", str(exc.value))  # file, line, field


def test_missing_canary_block_is_named(tmp_path):
    (tmp_path / "params.yaml").write_text("gate: {seed: 0}\n")
    with pytest.raises(QuantgateError, match="no block 'canary'"):
        load_policy(tmp_path / "params.yaml")


def test_serve_params_applies_a_roles_port_and_appends_its_args():
    base = ServeParams(extra_args=["--enforce-eager"])
    p = serve_params(base, ServerOverride(port=9001, extra_args=["--max-num-seqs", "8"]))
    assert p.port == 9001 and p.extra_args == ["--enforce-eager", "--max-num-seqs", "8"]
    assert p.dtype == base.dtype and base.port == 0
