"""The CI-sized canary of the e2e tests, in one place: tests/test_fleet_e2e.py and tests/test_serve_e2e.py run it,
tests/test_canary_plan.py checks it is feasible, and benchmarks/canary_sim.py simulates it (its "e2e" rows).

FAST changes params.yaml's `canary` block (same steps, smaller minimums), FAST_ROUTER its `fleet.router` block
(every greedy candidate answer shadowed, two words compared), FAST_BOUNDS the checks' bounds."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FAST = dict(measure_s=6, min_step_s=3, max_step_s=240, min_samples=2, check_interval_s=2)
FAST_ROUTER = dict(shadow_fraction=1.0, shadow_compare_words=2)
FAST_BOUNDS = dict(shadow_agreement=0.5)


def fast_policy(**over):
    """The canary policy of params.yaml with FAST and FAST_BOUNDS; a check's name sets its bound
    (ttft_p95_ratio=50), other keys the policy's fields."""
    from canary.policy import CHECK_KINDS, load_policy

    # judge quality and errors here, not speed: how fast GOOD is against fp16 is the machine's (AVX2 at float32:
    # int8 decodes ~1.6x slower; AVX512: int4's TTFT p50 is 1.5-1.7x fp16's), and a ratio near 1.5 holds a
    # CI-sized step to max_step_s; the latency checks are tested in tests/test_canary_analysis.py and simulated
    bounds = dict(FAST_BOUNDS, ttft_p95_ratio=50, tpot_p95_ratio=50)
    bounds.update({k: over.pop(k) for k in list(over) if k in CHECK_KINDS})  # e.g. ttft_p95_ratio=50
    policy = load_policy(REPO / "params.yaml").model_copy(update={**FAST, **over})
    return policy.with_bounds(**bounds)


def fast_router():
    """The router settings of params.yaml (fleet.router) with FAST_ROUTER, 120 s per attempt on a busy CPU."""
    from gateway.fleet import load_fleet_params

    return load_fleet_params(REPO / "params.yaml").router.model_copy(update={**FAST_ROUTER, "request_timeout_s": 120})
