"""What each build buys: profiles priced by the cost block (the chapter's worked example through the gate's
path), the recommendation, the report's table and plot, the version description and `quantgate status`'s cell."""

import json

import pytest

from pipeline import buys
from pipeline.gate import GateParams, gate, report
from pipeline.register import version_description
from quantgate.cost import CostParams
from quantgate.errors import QuantgateError
from quantgate.results import BuildCost, BuildGate, BuildProfile, LoadPoint, read_gate, write_gate
from quantgate.teams import load_teams
from registry.approval import read_recommendation
from registry.status import buys_cell
from registry.tags import buys_tags
from tests.conftest import write_scores

SHAPE = {"layers": 30, "kv_heads": 3, "head_dim": 64, "query_heads": 9, "max_context": 8192}


def measured(build, kv_tokens, tok_s, ttft_ms, tpot_ms, c=8, weights=256.6):
    load = LoadPoint(
        concurrency=c,
        prompts=c,
        output_tokens_per_s=tok_s,
        requests_per_s=1.0,
        ttft_ms_p50=ttft_ms,
        ttft_ms_p99=ttft_ms,
        tpot_ms_p50=tpot_ms,
        tpot_ms_p99=tpot_ms,
    )
    small = load.model_copy(update={"concurrency": 1, "output_tokens_per_s": 1.0})
    return BuildProfile(
        build=build,
        status="profiled",
        input_len=32,
        output_len=16,
        seed=1234,
        weights_mib=weights,
        kv_tokens=kv_tokens,
        kv_shape=SHAPE,
        max_concurrency_at=2048,
        loads={"c1": small, f"c{c}": load},
    )


def test_the_chapters_worked_example_through_the_gates_pricing():
    # 104 requests of 4,096 tokens per device; 50 QPS at 350 ms TTFT + 250 x 22 ms: 292 in flight,
    # 4 devices when memory binds, 12 at a batch cap of 32, 80 % utilization; $2.50/h at 900 tok/s = $0.77
    cost = CostParams(gpu_hour_usd=2.5, qps=50, context_tokens=4096, output_tokens=250, batch_cap=32)
    c = buys.price(measured("fp16", 104 * 4096 + 100, 900.0, 350, 22, c=32), cost)
    assert c.requests_per_device == 104 and c.in_flight == pytest.approx(292.5)
    assert (c.devices_memory, c.devices_batch, c.devices, c.bound) == (4, 12, 12, "batch cap")
    assert c.usd_per_mtok == pytest.approx(0.7716, abs=1e-4) and c.output_tokens_per_s == 900.0  # largest C
    assert buys.price(
        BuildProfile(build="int4", status="unprofiled", reason="no W4A16 kernel", input_len=32, output_len=16, seed=1),
        cost,
    ).dump() == {"status": "unprofiled", "reason": "no W4A16 kernel", "kv_cache_dtype": "auto", "weights_mib": None}


def passing(verdict="PASS"):
    return BuildGate(verdict=verdict, shippable=verdict == "PASS", teams={})


def test_recommended_only_when_non_inferior_and_cheaper():
    cheap, dear = BuildCost(status="profiled", usd_per_mtok=0.5), BuildCost(status="profiled", usd_per_mtok=1.5)
    base = BuildCost(status="profiled", usd_per_mtok=1.0)
    assert buys.recommend(passing(), cheap, base, "fp16") == (
        True,
        "PASS for every team and 0.50x fp16's cost per 1M output tokens on this platform",
    )
    ok, why = buys.recommend(passing(), dear, base, "fp16")
    assert not ok and why.startswith("PASS, but costs $1.500 per 1M output tokens vs $1.000 for fp16 (1.50x)")
    same = BuildCost(status="profiled", usd_per_mtok=1.0)  # as dear as the baseline: not cheaper
    assert buys.recommend(passing(), same, base, "fp16")[0] is False
    assert buys.recommend(passing("INCONCLUSIVE"), cheap, base, "fp16") == (
        False,
        "not non-inferior for every team (gate INCONCLUSIVE)",
    )
    free = BuildCost(status="profiled", usd_per_mtok=0.0)  # a price rounded to $0: the gate stopped on 0 / 0
    assert buys.recommend(passing(), free, free, "fp16") == (
        False,
        "fp16's cost rounds to $0 per 1M output tokens (cost.gpu_hour_usd too small), so no cost to compare with",
    )
    unprofiled = BuildCost(status="unprofiled", reason="vLLM server exited")
    assert buys.recommend(passing(), unprofiled, base, "fp16") == (False, "unprofiled: vLLM server exited")
    assert buys.recommend(passing(), cheap, unprofiled, "fp16") == (
        False,
        "fp16 unprofiled, so no cost to compare with: vLLM server exited",
    )


def test_bad_cost_params_name_file_line_and_field(tmp_path):
    p = tmp_path / "params.yaml"
    base = measured("fp16", 46592, 40.0, 1266, 126)
    for price in (-1, 0):  # 0: every build costs the same $0, and the gate divided by it
        p.write_text(f"cost:\n  gpu_hour_usd: {price}\n")
        with pytest.raises(QuantgateError, match=r"params.yaml:2: cost.gpu_hour_usd: Input should be greater than 0"):
            buys.load_cost(base, p)
    p.write_text("cost:\n  qps: 1\n  context_tokens: 9000\n")
    with pytest.raises(QuantgateError, match=r"params.yaml:3: cost.context_tokens: 9000 tokens is longer than the mo"):
        buys.load_cost(base, p)
    p.write_text("cost:\n  context_tokens: 4096\n")
    with pytest.raises(QuantgateError, match=r"params.yaml:2: cost.context_tokens: 4096 .* server's max_model_len"):
        buys.load_cost(base, p)
    p.write_text("cost:\n  context_tokens: 2048\n")
    assert buys.load_cost(base, p).context_tokens == 2048


@pytest.fixture
def priced(tmp_path, example_evals):
    """A gate over int8 (PASS, slower than fp16), fp8 (PASS, cheaper) and int4 (unprofiled), priced."""
    teams = [t for t in load_teams(example_evals) if t.name == "search"]
    for build in ("fp16", "int8", "fp8", "int4"):
        write_scores(tmp_path, build, "search", [1.0, 0.0] * 100)
    result = gate(tmp_path, teams, GateParams(baseline="fp16", candidates=["int8", "fp8", "int4"]))
    profiles = {
        "fp16": measured("fp16", 46592, 40.0, 1266, 126),
        "int8": measured("int8", 46592, 31.0, 867, 216, weights=160.0),
        "fp8": measured("fp8", 46592, 80.0, 500, 60, weights=155.7),
        "int4": BuildProfile(
            build="int4",
            status="unprofiled",
            reason="no W4A16 kernel here",
            input_len=32,
            output_len=16,
            seed=1234,
            weights_mib=107.9,
        ),
    }
    cost = CostParams(gpu_hour_usd=0.1, qps=0.5, context_tokens=2048, output_tokens=250, batch_cap=32)
    return buys.apply(result, profiles, cost)


def test_priced_gate_result_report_plot_and_metrics(priced, tmp_path):
    b = priced.builds
    assert (b["int8"].recommended, b["fp8"].recommended, b["int4"].recommended) == (False, True, False)
    assert b["int4"].verdict == "PASS" and b["int4"].recommendation == "unprofiled: no W4A16 kernel here"
    fp16, int8 = priced.buys["fp16"], priced.buys["int8"]
    # $0.10/h / (3600 x 40 tok/s) x 1e6; 46,592 // 2,048 = 22 per device; 0.5 x (1.266 + 250 x 0.126) in flight
    assert fp16.usd_per_mtok == pytest.approx(0.6944, abs=1e-4) and fp16.requests_per_device == 22
    assert fp16.in_flight == pytest.approx(16.38, abs=0.01) and fp16.devices == 1 and fp16.usd_per_mtok_x == 1.0
    assert int8.usd_per_mtok_x == pytest.approx(40 / 31, abs=1e-3) and int8.weights_x == pytest.approx(0.624, abs=1e-3)
    md = report(priced, "gate_recovery.png", "gate_cost.png")
    assert "## What it buys when served" in md and "![quality vs cost per build](gate_cost.png)" in md
    table = md.split("## What it buys when served")[1]
    assert "| int4 | 107.9 | unprofiled [1] | - | - | - | - | - | - | - | no |" in table
    assert "\n- [1] int4 unprofiled: no W4A16 kernel here\n" in table  # the reason under the table, not in a cell
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert {line.count("|") for line in rows} == {12}  # every row has the header's 11 cells
    assert "| fp8 | 155.7 | 46,592 | 22 | 80.0 (8) | 500 / 60 | 0.347 | 1 (1 / 1) | 0.50 | 1.00 | yes |" in md
    write_gate(tmp_path / "gate.json", priced)  # DVC metrics: the figures travel, and read back
    assert read_gate(tmp_path / "gate.json").buys["fp8"].usd_per_mtok == pytest.approx(0.3472, abs=1e-4)
    assert json.loads((tmp_path / "gate.json").read_text())["builds"]["fp8"]["recommended"] is True
    points = buys.cost_points(priced)
    assert [p["build"] for p in points] == ["fp16", "int8", "fp8"] and points[0]["worst_recovery_pct"] == 100.0
    from pipeline.plot import cost_plot

    cost_plot(points, {"int4": "no W4A16 kernel here"}, tmp_path / "cost.png")
    assert (tmp_path / "cost.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_version_description_puts_this_build_first_and_links_the_run_artifacts(priced, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    md = report(priced, "gate_recovery.png", "gate_cost.png") + f"- int4: {tmp_path}/models/int4 cannot be served\n"
    text = version_description(priced, "fp8", "RUN123", md)
    assert text.startswith("# fp8: gate PASS, recommended\n")
    first_table = text.index("| fp8 | search |")
    assert first_table < text.index("# All builds") < text.index("| int8 | search |")
    assert text.index("| fp8 | 155.7 |") < text.index("| fp16 | 256.6 |") < text.index("# All builds")
    assert "](get-artifact?path=gate_cost.png&run_uuid=RUN123)" in text
    assert "](gate_recovery.png)" not in text and "](gate_cost.png)" not in text  # a relative image is broken there
    assert text.count("](get-artifact?path=gate_recovery.png&run_uuid=RUN123)") == 1
    assert str(tmp_path) not in text and "- int4: models/int4 cannot be served" in text


def test_tags_status_cell_and_recommendation_override():
    t = buys_tags(BuildCost(status="profiled", usd_per_mtok=0.8961, usd_per_mtok_x=1.29), passing())
    assert t["buys.usd_per_mtok"] == "0.8961" and "recommended" not in t  # the gate priced, but did not recommend
    t = buys_tags(
        BuildCost(status="profiled", usd_per_mtok=0.8961, usd_per_mtok_x=1.29),
        passing().model_copy(update={"recommended": False, "recommendation": "PASS, but costs more"}),
    )
    assert buys_cell(t) == "$0.896 (1.29x) reco=no"
    assert read_recommendation(t) == ("no", "not recommended: PASS, but costs more")
    t |= {"recommendation.override_by": "alice", "recommendation.override_reason": "GPU fleet: FP8 is native"}
    assert read_recommendation(t)[0] == "override" and "alice's override: GPU fleet" in read_recommendation(t)[1]
    assert buys_cell({"buys.status": "unprofiled", "recommended": "no"}) == "unprofiled reco=no"
    assert buys_cell({}) == "-" and buys_tags(None, None) == {}
