"""canary/forecast.py: the release record's latency figures against the policy's latency checks."""

from canary.forecast import latency_forecast
from canary.policy import CanaryPolicy
from pipeline.buys import price_all
from quantgate.cost import CostParams
from registry.tags import buys_tags
from tests.test_buys import measured


def profiled(ttft: float, tpot: float, concurrency: str = "8") -> dict[str, str]:
    return {
        "buys.status": "profiled",
        "buys.concurrency": concurrency,
        "buys.ttft_ms_p50": str(ttft),
        "buys.tpot_ms_p50": str(tpot),
    }


POLICY = CanaryPolicy()  # params.yaml's defaults: ttft and tpot p95 ratios at most 1.5


def test_a_candidate_profiled_slower_than_the_ratio_allows_is_forecast_to_abort():
    # the fresh-clone demo's figures on an AVX2 CPU: int8 TPOT p50 224 ms, fp16 132 ms at 8 in flight
    lines = latency_forecast(POLICY, ("1", profiled(1157, 132)), ("2", profiled(1019, 224)))
    assert lines == [
        "v2's profile has TPOT p50 224 ms against 132 ms for v1 (at 8 in flight, where `dvc repro` profiled "
        "them): 1.70x, above tpot_p95_ratio max 1.5; on that kind of machine expect this canary to abort on "
        "tpot_p95_ratio"
    ]  # TTFT 1019 / 1157 = 0.88x: no line


def test_nothing_is_forecast_within_the_ratios_or_without_comparable_profiles():
    stable = ("1", profiled(1000, 100))
    assert latency_forecast(POLICY, stable, ("2", profiled(1500, 150))) == []  # exactly at the bound: not above
    assert latency_forecast(POLICY, stable, ("2", profiled(3000, 300, concurrency="1"))) == []  # other concurrency
    assert latency_forecast(POLICY, stable, ("2", {"buys.status": "unprofiled", "buys.reason": "no kernel"})) == []
    assert latency_forecast(POLICY, stable, ("2", {})) == []  # registered before these tags existed
    assert latency_forecast(POLICY, stable, ("2", {**profiled(1, 1), "buys.tpot_ms_p50": "nan?"})) == []
    relaxed = CanaryPolicy().with_bounds(tpot_p95_ratio=2.5)  # a latency budget written into the policy
    assert latency_forecast(relaxed, ("1", profiled(1157, 132)), ("2", profiled(1019, 224))) == []
    no_latency = CanaryPolicy(checks=[{"name": "error_rate", "max": 0.01}])
    assert latency_forecast(no_latency, ("1", profiled(100, 10)), ("2", profiled(900, 90))) == []


def test_the_register_stage_tags_carry_the_figures_the_forecast_reads():
    cost = CostParams(gpu_hour_usd=0.1, qps=0.5, context_tokens=2048, output_tokens=250, batch_cap=32)
    profiles = {"fp16": measured("fp16", 46592, 40.0, 1266, 126), "int8": measured("int8", 46592, 31.0, 867, 216)}
    priced = price_all(profiles, cost, "fp16")
    stable, candidate = buys_tags(priced["fp16"], None), buys_tags(priced["int8"], None)
    assert (candidate["buys.tpot_ms_p50"], candidate["buys.concurrency"]) == ("216.0", "8")
    assert "1.71x, above tpot_p95_ratio max 1.5" in latency_forecast(POLICY, ("1", stable), ("2", candidate))[0]
