"""What each build buys when served: its profile priced by the `cost` params block, the recommendation, the table.

A private helper of the gate stage (pipeline/gate.py). Every rule is quantgate/cost.py's (the design
chapter's arithmetic, its worked example in tests/test_cost.py); this module only applies them to the
measured profiles (results/profile/<build>.json, pipeline/profile.py):
- one device's output tokens/s, TTFT and TPOT are those measured at the largest profiled concurrency
  (profile.concurrency), the load closest to a full batch;
- $ per 1M output tokens = cost.gpu_hour_usd / (3600 x that tokens/s) x 1e6;
- requests per device (memory bound) = vLLM's reported KV tokens // cost.context_tokens: vLLM's figure
  already leaves out the weights (GPU) or is the configured KV space (CPU);
- requests in flight = cost.qps x (TTFT + cost.output_tokens x TPOT) (Little's law); devices = the larger
  of ceil(in flight / (requests per device x utilization)) and ceil(in flight / (batch_cap x utilization)).
A build is *recommended* only if its gate verdict is PASS (non-inferior for every team) and it costs less
per 1M output tokens than the baseline build on the platform it was measured on; that is a separate field
from the verdict, which it never changes.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.report import fmt
from quantgate.cost import (
    CostParams,
    KVShape,
    check_context,
    check_max_model_len,
    devices_for,
    in_flight,
    usd_per_million_tokens,
)
from quantgate.errors import QuantgateError
from quantgate.params import PARAMS_FILE, load_block, where
from quantgate.results import BuildCost, BuildGate, BuildProfile, GateResult, read_profile
from quantgate.stats import BASELINE, Verdict


def load_cost(baseline: BuildProfile | None, path: Path = PARAMS_FILE) -> CostParams:
    """params.yaml block `cost`, checked against the model's context and the server's max_model_len as the
    baseline's profile recorded them (kv_shape.max_context, max_concurrency_at; unchecked where unknown).

    Raises QuantgateError "params.yaml:<line>: cost.<field>: ..." for a bad field (negative price, unknown
    key, ...) and for a context longer than the model's or the server's."""
    cost = load_block("cost", CostParams, path)
    at = f"{where(path, 'cost.context_tokens')}: cost.context_tokens"
    if baseline is not None and baseline.kv_shape:
        check_context(cost, KVShape(**baseline.kv_shape), at)
    check_max_model_len(cost, baseline.max_concurrency_at if baseline is not None else None, at)
    return cost


def read_profiles(profile_dir: Path, builds: list[str]) -> dict[str, BuildProfile]:
    """{build: its profile} from `profile_dir`/<build>.json; a missing or unreadable file is an unprofiled
    record whose reason says so (the gate never fails for a missing profile: that build is not recommended)."""
    out = {}
    for build in builds:
        try:
            out[build] = read_profile(profile_dir / f"{build}.json")
        except QuantgateError as exc:
            out[build] = BuildProfile(
                build=build, status="unprofiled", reason=str(exc), input_len=0, output_len=0, seed=0
            )
    return out


def price(profile: BuildProfile, cost: CostParams) -> BuildCost:
    """One build's BuildCost (no ratios yet) from its profile and the cost block; see the module docstring.
    An unprofiled build, or one without a KV figure or throughput, is "unprofiled" with the reason."""
    base = {"weights_mib": profile.weights_mib, "kv_cache_dtype": profile.kv_cache_dtype}
    if profile.status != "profiled":
        return BuildCost(status="unprofiled", reason=profile.reason, **base)
    if not profile.loads or not profile.kv_tokens:
        why = "no load measured" if not profile.loads else "vLLM reported no KV-cache size"
        return BuildCost(status="unprofiled", reason=f"profile incomplete: {why}", **base)
    top = profile.top_load()
    if top.output_tokens_per_s <= 0:
        return BuildCost(status="unprofiled", reason="profile measured no output tokens", **base)
    per_device = profile.kv_tokens // cost.context_tokens
    flight = in_flight(cost.qps, top.ttft_ms_p50 / 1000, cost.output_tokens, top.tpot_ms_p50 / 1000)
    figures = {
        "kv_tokens": profile.kv_tokens,
        "requests_per_device": per_device,
        "concurrency": top.concurrency,
        "output_tokens_per_s": top.output_tokens_per_s,
        "ttft_ms_p50": top.ttft_ms_p50,
        "tpot_ms_p50": top.tpot_ms_p50,
        "usd_per_mtok": round(usd_per_million_tokens(cost.gpu_hour_usd, top.output_tokens_per_s), 4),
        "in_flight": round(flight, 2),
    }
    try:
        d = devices_for(flight, per_device, cost.batch_cap, cost.utilization)
        figures |= {"devices_memory": d.memory, "devices_batch": d.batch, "devices": d.needed, "bound": d.bound}
    except QuantgateError as exc:  # not one request of context_tokens fits: priced, but no device count
        figures["bound"] = f"none: {exc}"
    return BuildCost(status="profiled", **base, **figures)


def _x(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def price_all(profiles: dict[str, BuildProfile], cost: CostParams, baseline: str) -> dict[str, BuildCost]:
    """{build: BuildCost with its ratios to `baseline`} for every profile (the baseline's ratios are 1)."""
    costs = {b: price(p, cost) for b, p in profiles.items()}
    base = costs.get(baseline)
    out = {}
    for build, c in costs.items():
        if base is None:
            out[build] = c
            continue
        out[build] = c.model_copy(
            update={
                "usd_per_mtok_x": _x(c.usd_per_mtok, base.usd_per_mtok),
                "devices_x": _x(c.devices, base.devices),
                "weights_x": _x(c.weights_mib, base.weights_mib),
                "kv_tokens_x": _x(c.kv_tokens, base.kv_tokens),
            }
        )
    return out


def recommend(gate: BuildGate, cost: BuildCost | None, base: BuildCost | None, baseline: str) -> tuple[bool, str]:
    """(recommended, why) for one candidate: PASS for every team AND fewer $ per 1M output tokens than `baseline`."""
    if gate.verdict != Verdict.PASS:
        return False, f"not non-inferior for every team (gate {gate.verdict})"
    if cost is None or cost.status != "profiled" or cost.usd_per_mtok is None:
        return False, f"unprofiled: {cost.reason if cost else 'no profile'}"
    if base is None or base.status != "profiled" or base.usd_per_mtok is None:
        return False, f"{baseline} unprofiled, so no cost to compare with: {base.reason if base else 'no profile'}"
    if base.usd_per_mtok <= 0:  # rounded to 4 decimals: a device price far below a cent an hour
        return False, (
            f"{baseline}'s cost rounds to $0 per 1M output tokens (cost.gpu_hour_usd too small), so no cost to "
            "compare with"
        )
    x = cost.usd_per_mtok / base.usd_per_mtok
    if x >= 1:
        return False, (
            f"PASS, but costs ${cost.usd_per_mtok:.3f} per 1M output tokens vs ${base.usd_per_mtok:.3f} for "
            f"{baseline} ({x:.2f}x) on this platform"
        )
    return True, f"PASS for every team and {x:.2f}x {baseline}'s cost per 1M output tokens on this platform"


def apply(result: GateResult, profiles: dict[str, BuildProfile], cost: CostParams) -> GateResult:
    """`result` with `buys` (every profiled build, the baseline too) and each candidate's recommendation."""
    buys = price_all(profiles, cost, result.baseline)
    builds = {}
    for build, g in result.builds.items():
        ok, why = recommend(g, buys.get(build), buys.get(result.baseline), result.baseline)
        builds[build] = g.model_copy(update={"recommended": ok, "recommendation": why})
    return result.model_copy(update={"builds": builds, "buys": buys})


def worst_recovery(g: BuildGate) -> float | None:
    """The lowest recovery % over the build's teams (None if no team could be compared)."""
    values = [c.recovery_pct for c in g.teams.values() if c.recovery_pct is not None]
    return min(values) if values else None


def buys_table(result: GateResult, builds: list[str] | None = None) -> str:
    """The "what it buys" markdown table: one row per build (`builds`, default: baseline then candidates).
    An unprofiled build's row says "unprofiled [n]" with dashes for its figures; its reason is note [n] under
    the table, so a long reason does not stretch one cell across the table."""
    order = builds or [result.baseline, *result.builds]
    lines = [
        "| build | weights MiB | KV tokens | req/device | tok/s (C) | TTFT / TPOT ms p50 | $ / 1M tok | devices "
        "(memory / batch) | $ x | devices x | recommended |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for build in order:
        c = result.buys.get(build)
        g = result.builds.get(build)
        rec = "baseline" if build == result.baseline else ("yes" if g and g.recommended else "no")
        if c is None or c.status != "profiled":
            notes.append(f"- [{len(notes) + 1}] {build} unprofiled: {(c.reason if c else 'no profile') or '?'}")
            dashes = " - |" * 7
            lines.append(f"| {build} | {fmt(c and c.weights_mib, '.1f')} | unprofiled [{len(notes)}] |{dashes} {rec} |")
            continue
        devices = f"{fmt(c.devices, 'd')} ({fmt(c.devices_memory, 'd')} / {fmt(c.devices_batch, 'd')})"
        lines.append(
            f"| {build} | {fmt(c.weights_mib, '.1f')} | {fmt(c.kv_tokens, ',')} | {fmt(c.requests_per_device, 'd')} | "
            f"{c.output_tokens_per_s:.1f} ({c.concurrency}) | {c.ttft_ms_p50:.0f} / {c.tpot_ms_p50:.0f} | "
            f"{c.usd_per_mtok:.3f} | {devices} | {fmt(c.usd_per_mtok_x, '.2f')} | {fmt(c.devices_x, '.2f')} | {rec} |"
        )
    return "\n".join(lines + ([""] + notes if notes else []))


def cost_points(result: GateResult) -> list[dict]:
    """The quality-vs-cost plot's data (results/gate_cost.json, a DVC plot): per profiled build its $ per 1M
    output tokens and worst-team recovery % (the baseline at 100)."""
    points = []
    for build in [result.baseline, *result.builds]:
        c = result.buys.get(build)
        if c is None or c.usd_per_mtok is None:
            continue
        g = result.builds.get(build)
        rec = 100.0 if build == result.baseline else (worst_recovery(g) if g else None)
        points.append(
            {
                "build": build,
                "usd_per_mtok": c.usd_per_mtok,
                "worst_recovery_pct": None if rec is None else round(rec, 2),
                "verdict": g.verdict if g else BASELINE,
                "recommended": bool(g and g.recommended),
            }
        )
    return points
