"""The gate on scores documents written in the test: verdicts and failing closed."""

import json
import re
import warnings

import pytest

from pipeline.gate import GateParams, gate, load_params, report
from quantgate.errors import QuantgateError
from quantgate.results import TeamComparison, check_consistent, read_gate, write_gate
from quantgate.teams import load_teams
from tests.conftest import REPO, write_scores

PARAMS = GateParams(baseline="fp16", candidates=["int4"], bootstrap_resamples=1000)


@pytest.fixture
def teams(example_evals):
    return [t for t in load_teams(example_evals) if t.name == "search"]  # acc, absolute margin 0.05


def row(result, build="int4", team="search"):
    return result.builds[build].teams[team]


def test_identical_large_set_passes(tmp_path, teams):
    scores = [1.0, 0.0] * 100
    write_scores(tmp_path, "fp16", "search", scores)
    write_scores(tmp_path, "int4", "search", scores)
    result = gate(tmp_path, teams, PARAMS)
    r = row(result)
    assert r.verdict == "PASS"
    assert (result.builds["int4"].verdict, result.builds["int4"].shippable) == ("PASS", True)
    assert r.n == 200 and r.drop == 0.0 and r.recovery_pct == 100.0
    assert r.upper == pytest.approx(2.7055 / (200 + 2.7055), rel=1e-3)


def test_clear_drop_fails(tmp_path, teams):
    write_scores(tmp_path, "fp16", "search", [1.0] * 100)
    write_scores(tmp_path, "int4", "search", [1.0] * 70 + [0.0] * 30)
    result = gate(tmp_path, teams, PARAMS)
    assert row(result).verdict == "FAIL"
    assert row(result).drop == pytest.approx(0.30)
    assert result.builds["int4"].shippable is False


def test_small_set_is_inconclusive_with_needed_n(tmp_path, teams):
    write_scores(tmp_path, "fp16", "search", [1.0, 0.0] * 5)
    write_scores(tmp_path, "int4", "search", [1.0, 0.0] * 5)
    result = gate(tmp_path, teams, PARAMS)
    r = row(result)
    assert r.verdict == "INCONCLUSIVE"
    # shippable only if every team PASSes: an undecided team is no release (`worst is not FAIL` passed every test)
    assert (result.builds["int4"].verdict, result.builds["int4"].shippable) == ("INCONCLUSIVE", False)
    assert r.n_required == 52  # z^2 (1 - m) / m for b = c = 0, m = 0.05
    assert "52 docs" in r.reason


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", "no results for build int4"),
        ("error", "evaluation error: vLLM server exited"),
        ("fewer_docs", "document sets differ: 10 docs on fp16 vs 9 on int4"),
        ("other_docs", "document content differs"),
        ("nan", "is nan"),
        ("inf", "is inf"),
        ("-inf", "is -inf"),
        ("overflowing_drop", "the acc scores are too large to compare (a per-document drop, a mean or their spread"),
        ("overflowing_spread", "the acc scores are too large to compare"),
    ],
)
def test_fails_closed_with_reason(tmp_path, teams, case, expected):
    write_scores(tmp_path, "fp16", "search", [1.0] * 10)
    if case == "error":
        write_scores(tmp_path, "int4", "search", [], status="error", reason="vLLM server exited with code 1")
    elif case == "fewer_docs":
        write_scores(tmp_path, "int4", "search", [1.0] * 9)
    elif case == "other_docs":
        write_scores(tmp_path, "int4", "search", [1.0] * 10, hashes={3: "changed"})
    elif case == "nan":
        write_scores(tmp_path, "int4", "search", [1.0] * 9 + [float("nan")])
    elif case in ("inf", "-inf"):  # an infinite score: no finite bound of the drop (a PASS with lower -inf was written)
        write_scores(tmp_path, "int4", "search", [1.0] * 9 + [float(case)])
    elif case == "overflowing_drop":  # finite scores whose difference is not: a traceback (OverflowError) before
        write_scores(tmp_path, "fp16", "search", [1.0] * 9 + [1.7e308])
        write_scores(tmp_path, "int4", "search", [1.0] * 9 + [-1.7e308])
    elif case == "overflowing_spread":  # a finite drop whose variance is not
        write_scores(tmp_path, "int4", "search", [1.0] * 9 + [-1e308])
    result = gate(tmp_path, teams, PARAMS)
    r = row(result)
    assert r.verdict == "FAIL" and list(r.dump()) == ["verdict", "metric", "reason"]
    assert expected in r.reason
    write_gate(tmp_path / "gate.json", result)  # what the gate writes, report and register read
    check_consistent(read_gate(tmp_path / "gate.json"), tmp_path / "gate.json")


@pytest.mark.parametrize(
    "fp16, int4",
    [
        ([1.0] * 9 + [1.7e308], [1.0] * 9 + [-1.7e308]),  # a drop that overflows (numpy: "overflow in subtract")
        ([1.0] * 8 + [1.7e308] * 2, [1.0] * 8 + [1.7e308] * 2),  # means that overflow ("overflow in reduce")
    ],
)
def test_overflowing_scores_fail_closed_with_the_reason_alone(tmp_path, teams, fp16, int4):
    """The reason says the scores overflow; numpy's RuntimeWarning was printed into the gate's log beside it."""
    write_scores(tmp_path, "fp16", "search", fp16)
    write_scores(tmp_path, "int4", "search", int4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any numpy warning fails the test
        r = row(gate(tmp_path, teams, PARAMS))
    assert r.verdict == "FAIL" and "the acc scores are too large to compare" in r.reason


def test_one_team_failing_fails_the_build_and_report_names_it(tmp_path, example_evals):
    teams = load_teams(example_evals)
    for t in teams:
        write_scores(tmp_path, "fp16", t.name, [1.0, 0.0] * 100)
        write_scores(tmp_path, "int4", t.name, [1.0, 0.0] * 100 if t.name != "billing" else [0.0] * 200)
    result = gate(tmp_path, teams, PARAMS)
    assert {k: v.verdict for k, v in result.builds["int4"].teams.items()} == {
        "billing": "FAIL",
        "search": "PASS",
        "support": "PASS",
    }
    assert result.builds["int4"].verdict == "FAIL"
    md = report(result)
    assert "| int4 | billing | exact_match | 200 | 0.500 | 0.000 | +0.500 | [+0.442, +0.558] |" in md  # drop: + = worse
    assert "| drop (+ = worse) | drop CI |" in md and "delta" not in md
    assert "int4 / billing: FAIL" in md
    write_gate(tmp_path / "gate.json", result)  # the metrics file: read back as written, same keys as ever
    on_disk = json.loads((tmp_path / "gate.json").read_text())
    assert read_gate(tmp_path / "gate.json") == result and result.dump() == on_disk  # registry evidence digests
    assert list(on_disk) == ["baseline", "precision", "builds"]
    assert list(on_disk["builds"]["int4"]) == ["verdict", "shippable", "teams"]
    assert list(on_disk["builds"]["int4"]["teams"]["billing"]) == [
        *("verdict", "metric", "higher_is_better", "n", "baseline", "candidate", "delta", "margin", "recovery_pct"),
        *("confidence", "method", "drop", "lower", "upper", "p_value", "p_difference", "n_required", "discordant"),
        "reason",
    ]


def test_recovery_interval_maps_drop_bounds():
    from pipeline.plot import recovery_interval

    c = TeamComparison(
        verdict="PASS", metric="acc", higher_is_better=True, baseline=0.8, lower=-0.02, upper=0.04, reason=""
    )
    assert recovery_interval(c) == pytest.approx((95.0, 102.5))
    lower_is_better = c.model_copy(update={"baseline": 2.0, "higher_is_better": False})
    assert recovery_interval(lower_is_better) == pytest.approx((100 * 2 / 2.04, 100 * 2 / 1.98))
    # a lower-is-better candidate whose bound reaches 0 or below (0.01 - 0.02) has no recovery ratio
    assert recovery_interval(lower_is_better.model_copy(update={"baseline": 0.01})) is None
    assert recovery_interval(TeamComparison(verdict="FAIL", metric="acc", reason="no results")) is None


def test_plot_and_report_written_for_pass_and_missing_build(tmp_path, teams):
    from pipeline.plot import recovery_plot

    write_scores(tmp_path, "fp16", "search", [1.0, 0.0] * 100)
    write_scores(tmp_path, "int4", "search", [1.0, 0.0] * 100)
    result = gate(tmp_path, teams, GateParams(baseline="fp16", candidates=["int4", "fp8"], bootstrap_resamples=1000))
    assert row(result, "fp8").verdict == "FAIL" and "missing" in row(result, "fp8").reason
    png = tmp_path / "out" / "gate_recovery.png"
    recovery_plot(result, png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert "![recovery per team and build](gate_recovery.png)" in report(result, png.name)


def test_with_every_candidate_refused_the_precision_line_names_the_baselines_and_where_it_ran(tmp_path, teams):
    """An AVX2-only machine refuses every candidate before any server (int4: no W4A16 kernel, int8: an inexact
    kernel): the report said "Served precision: unknown (no build was evaluated)", though fp16 was served, at
    float32, and the profile's figures come from that machine kind."""
    write_scores(tmp_path, "fp16", "search", [1.0, 0.0] * 100)
    record = {
        "dtype": "float32",
        "requested": "auto",
        "why": "auto: CPU without native bf16",
        "machine_kind": "AVX2-only",
    }
    (tmp_path / "fp16/precision.json").write_text(json.dumps(record))
    write_scores(tmp_path, "int4", "search", [], status="error", reason="vLLM cannot serve the W4A16 build here")
    result = gate(tmp_path, teams, PARAMS)
    assert row(result).verdict == "FAIL" and result.precision.dtype == "float32"
    assert (
        "Served precision: **float32** for fp16 (no candidate was compared with it) on an AVX2-only machine (auto: "
        "CPU without native bf16); kinds: docs/machines.md." in report(result)
    )
    # int4 scored, at another dtype: not "no candidate was scored", and not served at float32
    write_scores(tmp_path, "int4", "search", [1.0, 0.0] * 100)
    (tmp_path / "int4/precision.json").write_text(json.dumps({**record, "dtype": "bfloat16"}))
    assert "**float32** for fp16 (no candidate was compared with it) on an AVX2-only" in report(
        gate(tmp_path, teams, PARAMS)
    )
    (tmp_path / "fp16/precision.json").unlink()  # no record at all: still said, not guessed
    assert "Served precision: unknown (no build was evaluated)." in report(gate(tmp_path, teams, PARAMS))


def test_builds_served_at_different_precisions_fail_closed_and_the_report_names_the_precision(tmp_path, teams):
    scores = [1.0, 0.0] * 100
    write_scores(tmp_path, "fp16", "search", scores)
    write_scores(tmp_path, "int4", "search", scores)
    result = gate(tmp_path, teams, PARAMS)
    assert row(result).verdict == "PASS"
    assert result.precision.dump() == {
        "dtype": "float32",
        "requested": "auto",
        "why": "auto: test",
        "machine_kind": None,
    }
    assert "Served precision: **float32** for every build (auto: test); kinds: docs/machines.md." in report(result)
    # the machine kind the figures come from, as the probe named it (precision.json)
    for build in ("fp16", "int4"):
        record = {"dtype": "float32", "requested": "auto", "why": "auto: test", "machine_kind": "AVX2-only"}
        (tmp_path / build / "precision.json").write_text(json.dumps(record))
    assert "**float32** for every build on an AVX2-only machine (auto: test)" in report(gate(tmp_path, teams, PARAMS))
    # a second candidate scored at another dtype: it was not served at float32, so "every build" would be false
    write_scores(tmp_path, "int8", "search", scores)
    (tmp_path / "int8" / "precision.json").write_text(json.dumps({**record, "dtype": "bfloat16"}))
    two = gate(tmp_path, teams, PARAMS.model_copy(update={"candidates": ["int4", "int8"]}))
    assert two.builds["int8"].verdict == "FAIL" and two.builds["int4"].verdict == "PASS"
    assert (
        "Served precision: **float32** for fp16 and the candidates compared with it (int4) on an AVX2-only machine "
        "(auto: test)" in report(two)
    )
    # scored on another kind of device (a Ray node of another group): the kernels differ, so do the scores
    record = {"dtype": "float32", "requested": "auto", "why": "auto: test", "machine_kind": "GPU (NVIDIA H200)"}
    (tmp_path / "int4" / "precision.json").write_text(json.dumps({**record, "executor": "ray"}))
    r = row(gate(tmp_path, teams, PARAMS))
    assert r.verdict == "FAIL"
    assert r.reason == (
        "fp16 was evaluated on AVX2-only and int4 on GPU (NVIDIA H200): the gate compares builds on one kind of "
        "device; evaluate every build on one kind (executor.resources naming those nodes) and re-run `dvc repro`"
    )
    (tmp_path / "int4" / "precision.json").write_text(json.dumps({"dtype": "bfloat16", "requested": "auto"}))
    r = row(gate(tmp_path, teams, PARAMS))
    assert r.verdict == "FAIL"
    assert r.reason.startswith("fp16 was evaluated at float32 and int4 at bfloat16: the gate compares builds at one")
    (tmp_path / "int4" / "precision.json").unlink()
    r = row(gate(tmp_path, teams, PARAMS))
    assert r.verdict == "FAIL" and r.reason.startswith("no precision record for build int4")


def test_the_builds_of_a_run_are_listed_once_in_params_yaml():
    """`builds` drives dvc.yaml's evaluate foreach and the gate's candidates; quantize.<build> blocks
    (dvc.yaml's quantize foreach) exist for exactly the builds that are not the baseline."""
    import yaml

    doc = yaml.safe_load((REPO / "params.yaml").read_text())
    params = load_params(REPO / "params.yaml")
    assert [params.baseline, *params.candidates] == doc["builds"] and set(doc["quantize"]) == set(params.candidates)
    assert "candidates" not in doc["gate"]


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "builds: [fp8, int4]\nquantize: {fp8: {}, int4: {}}\ngate: {baseline: fp16}\n",
            r"`builds` \['fp8', 'int4'\] has no fp16: every build is gated against the 16-bit build",
        ),
        ("builds: [fp16, fp8, fp8]\ngate: {baseline: fp16}\n", "names a build twice"),
        (
            "builds: [fp16, fp8]\nquantize: {fp8: {}}\ngate: {baseline: fp8}\n",
            "gate.baseline: 'fp8' is not the 16-bit build; the baseline is the one prepare makes, 'fp16'",
        ),
        ("builds: fp16\ngate: {baseline: fp16}\n", "`builds` must be a list of build names"),
        ("builds: [fp16, fp8]\nquantize: {fp8: {}}\ngate: {baseline: fp16, candidates: [fp8]}\n", "candidates"),
    ],
)
def test_gate_params_refuse_builds_that_do_not_add_up(tmp_path, text, message):
    (tmp_path / "params.yaml").write_text(text)
    with pytest.raises(QuantgateError, match=message):
        load_params(tmp_path / "params.yaml")


@pytest.mark.parametrize(
    "builds, quantize, expected",
    [
        ("[fp16, fp9]", "{fp8: {scheme: FP8_DYNAMIC}}", "builds ['fp9'] have no quantize.<build> block"),
        (
            "[fp16, fp8]",
            "{fp8: {scheme: FP8_DYNAMIC}, int5: {scheme: W4A16}}",
            "quantize.int5 is not a quantized build",
        ),
        ("[fp16, ../evals]", "{}", "`builds` ['../evals']: a build name is lowercase letters, digits, _ and -"),
        ("[]", "{}", "`builds` must be a list of build names"),
    ],
)
def test_builds_and_quantize_blocks_must_agree(tmp_path, builds, quantize, expected):
    from quantgate.params import load_builds

    params = tmp_path / "params.yaml"
    params.write_text(f"builds: {builds}\nquantize: {quantize}\n")
    with pytest.raises(QuantgateError, match=re.escape(expected)):
        load_builds(params)


def test_results_documents_refuse_what_they_cannot_read(tmp_path):
    from quantgate.results import read_scores

    path = tmp_path / "gate.json"
    with pytest.raises(QuantgateError, match=r"gate.json not found: run `dvc repro` \(the gate stage writes it\)"):
        read_gate(path)
    with pytest.raises(QuantgateError, match=r"^\S+ is a folder, not the gate result file; give the file the gate"):
        read_gate(tmp_path)  # was "not found"
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(QuantgateError, match=r"gate.json: not UTF-8 JSON, so not a gate result; re-run"):
        read_gate(path)
    path.write_text('{"baseline": "fp16",\n')
    with pytest.raises(QuantgateError, match=r"gate.json:2: invalid JSON; re-run `dvc repro gate`"):
        read_gate(path)
    path.write_text('{"baseline": "fp16", "precision": null, "builds": {"int4": {"verdict": "MAYBE"}}}')
    with pytest.raises(QuantgateError, match=r"gate.json: not a gate result \(builds.int4.verdict: "):
        read_gate(path)
    (tmp_path / "scores.json").write_text('{"status": "ok", "samples": [{"task": "t", "doc_id": 0, "scor": 1}]}')
    with pytest.raises(QuantgateError, match=r"not a scores document \(samples.0.scor: Extra inputs"):
        read_scores(tmp_path / "scores.json")
    for text in ("[]", "null", '"fp16"'):  # said "(: Input should be a valid dictionary or instance of GateResult)"
        path.write_text(text + "\n")
        with pytest.raises(
            QuantgateError, match=rf"gate.json: not a gate result \(not a JSON object: {re.escape(text)}\)"
        ):
            read_gate(path)


def test_report_says_whether_each_set_decides(tmp_path, teams):
    from quantgate.stats import docs_for_power, pass_probability

    base = [1.0] * 150 + [0.0] * 50
    cand = [0.0] * 10 + [1.0] * 140 + [1.0] * 10 + [0.0] * 40  # 20 of 200 documents flip, 10 each way
    write_scores(tmp_path, "fp16", "search", base)
    write_scores(tmp_path, "int4", "search", cand)
    text = report(gate(tmp_path, teams, PARAMS))
    p, need = pass_probability(200, 0.1, 0.05, 0.95), docs_for_power(0.1, 0.05, 0.95, 0.9)
    assert 0.3 < p < 0.9 and need > 200  # 200 documents are too few at 10 % disagreement and 5 points
    assert (
        f"- search: builds disagree with the baseline on up to 10.0% of documents; at that rate an equally good "
        f"build PASSes with probability {p:.0%} on n=200 (90% needs {need} documents)"
    ) in text


def test_a_build_whose_search_found_no_passing_candidate_fails_with_that_reason(tmp_path, teams):
    from quantgate.results import Screen, SearchResult, read_search, write_search

    scores = [1.0, 0.0] * 100
    for build in ("fp16", "int4", "int4-mixed"):
        write_scores(tmp_path / "eval", build, "search", scores)
    params = GateParams(baseline="fp16", candidates=["int4", "int4-mixed"], bootstrap_resamples=1000)
    search_file = tmp_path / "search.json"
    found = SearchResult(build="int4-mixed", recipe="recipes/int4.yaml", passed=True, chosen=3, layers=210)
    write_search(search_file, found)
    assert gate(tmp_path / "eval", teams, params, search_file).builds["int4-mixed"].verdict == "PASS"
    screens = [
        Screen(kept=k, outcome="fail", passed=False, worst_slack=-0.1, teams={}, effective_bits=b, seconds=1.0)
        for k, b in ((0, 4.25), (32, 5.98))
    ]
    failed = {"passed": False, "chosen": 0, "evaluations": 2, "screens": screens, "max_bits_per_weight": 6.0}
    failed["max_kept"] = 32
    write_search(search_file, found.model_copy(update=failed))
    result = gate(tmp_path / "eval", teams, params, search_file)
    b = result.builds["int4-mixed"]
    assert (b.verdict, b.shippable) == ("FAIL", False) and b.teams["search"].verdict == "PASS"  # the team row stays
    assert b.reason == (
        "none of the search's 2 screened candidates (0, 32 layers kept 16-bit; at most 6 bits per weight) was shown "
        "to pass every team, so it keeps 0 of 210 layers 16-bit (results/search/trace.md); raise "
        "search.max_bits_per_weight (its most layers kept, 32, FAILed); or change the base recipe"
    )
    assert result.builds["int4"].verdict == "PASS"  # another build's search result is not its own
    assert f"  - {b.reason}" in report(result)
    write_search(search_file, found.model_copy(update={**failed, "screens": screens[1:], "evaluations": 1}))
    write_search(search_file, read_search(search_file).model_copy(update={"kept_is_cheaper": True}))
    assert (
        gate(tmp_path / "eval", teams, params, search_file)
        .builds["int4-mixed"]
        .reason.startswith(
            "the search's one screened candidate (32 layers kept 16-bit; at most 6 bits per weight; the cheapest here, "
            "where the quantized kernel is the slower one) was not shown to pass every team, so it keeps 0 of 210"
        )
    )


def test_the_advice_for_a_search_that_found_nothing_follows_what_stopped_it():
    from pipeline.gate import search_advice
    from quantgate.results import Screen, SearchResult

    def screen(kept, outcome):
        return Screen(kept=kept, outcome=outcome, passed=False, worst_slack=-0.1, teams={}, effective_bits=5, seconds=1)

    base = SearchResult(build="int4-mixed", recipe="recipes/int4.yaml", max_bits_per_weight=6.0, max_kept=45)
    undecided = base.model_copy(update={"screens": [screen(0, "undecided"), screen(45, "fail")]})
    assert search_advice(undecided) == (
        "raise search.doc_budget or add a later look to search.looks (a screen ended undecided); "
        "raise search.max_bits_per_weight (its most layers kept, 45, FAILed); or change the base recipe"
    )
    spent = base.model_copy(update={"screens": [screen(0, "fail"), screen(14, "fail")], "doc_budget": 300})
    assert search_advice(spent) == (  # nothing undecided, the bound never screened: the budget stopped it
        "raise search.doc_budget (its 300 documents ended the bisection); or change the base recipe"
    )


def test_the_gate_sets_the_searchs_cost_estimate_beside_the_measured_cost():
    from pipeline.gate import estimate_line
    from quantgate.results import BuildCost, BuildGate, GateResult, SearchResult

    search = SearchResult(build="int4-mixed", recipe="recipes/int4.yaml", chosen=45, est_ratio=1.552, priced_by="x")
    mixed = BuildGate(verdict="FAIL", shippable=False, teams={})
    measured = BuildCost(status="profiled", usd_per_mtok=0.344, usd_per_mtok_x=1.68)
    fp16 = BuildCost(status="profiled", usd_per_mtok=0.205, usd_per_mtok_x=1.0)
    buys = {"fp16": fp16, "int4-mixed": measured}
    result = GateResult(baseline="fp16", precision=None, builds={"int4-mixed": mixed}, buys=buys)
    assert estimate_line(result, search) == (  # 1.552 x fp16's measured $0.205
        "int4-mixed: the search estimated $0.318 per 1M output tokens (1.55x fp16) for 45 layers kept 16-bit; "
        "its profile measured $0.344 (1.68x)"
    )
    unprofiled = result.model_copy(update={"buys": {"int4-mixed": BuildCost(status="unprofiled", reason="r")}})
    assert estimate_line(unprofiled, search) == (
        "int4-mixed: the search estimated 1.55x fp16's cost per output token for 45 layers kept 16-bit; "
        "it has no measured cost to check it against"
    )
    assert f"  - {estimate_line(unprofiled, search)}" in report(unprofiled, search=search)
    assert estimate_line(result, search.model_copy(update={"est_ratio": None})) is None  # priced by bits
    assert estimate_line(result, search.model_copy(update={"chosen": 0})) is None  # the base build's own figure


def test_an_int8_build_served_through_an_inexact_kernel_says_so_in_its_line(tmp_path, teams):
    """evaluate.serve.inexact_int8 serves an int8 build whose kernel the probe found inexact (oneDNN without VNNI:
    0.253 for 32): its line says its scores hold the kernel's error. Only the int8 W8A8 build at the dtype it was
    served at; gate.json keeps its shape for the others."""
    from pipeline.gate import build_line
    from tests.test_serving import INT8_W8A8, build

    models, evals = tmp_path / "models", tmp_path / "eval"
    models.mkdir()
    build(models, "int8", INT8_W8A8)
    build(models, "int4", None)
    wrong = "wrong output [0.25, 0.25, 0.25, 0.25] (expected 32)"
    for b in ("fp16", "int8", "int4"):
        write_scores(evals, b, "search", [1.0, 0.0] * 100)
        record = {"dtype": "float32", "why": "auto: test", "w8a8": {"float32": wrong, "bfloat16": "ok"}}
        (evals / b / "precision.json").write_text(json.dumps(record))
    result = gate(evals, teams, GateParams(baseline="fp16", candidates=["int8", "int4"], bootstrap_resamples=1000),
                  models_dir=models)  # fmt: skip
    int8, int4 = result.builds["int8"], result.builds["int4"]
    assert int8.inexact_kernel == wrong and int8.verdict == "PASS"  # judged as served: the note is a fact
    assert "inexact_kernel" not in int4.dump()
    assert build_line("int8", int8) == (
        f"int8: PASS; served through an int8 kernel the platform probe found inexact here ({wrong}), by "
        "evaluate.serve.inexact_int8: its scores hold the kernel's error"
    )
    write_gate(tmp_path / "gate.json", result)
    assert read_gate(tmp_path / "gate.json").builds["int8"].inexact_kernel == wrong
    # refused before any server (inexact_int8 false): precision.json is there, but nothing was served through it
    int8_search = (evals / "int8/search/scores.json").read_text()
    write_scores(evals, "int8", "search", [], status="error", reason="vLLM cannot serve the int8 W8A8 build ...")
    refused = gate(evals, teams, PARAMS.model_copy(update={"candidates": ["int8"]}), models_dir=models).builds["int8"]
    assert refused.inexact_kernel is None and build_line("int8", refused) == "int8: FAIL"
    (evals / "int8/search/scores.json").write_text(int8_search)
    (evals / "int8/precision.json").write_text(json.dumps({**record, "dtype": "bfloat16"}))  # an exact kernel there
    assert (
        gate(evals, teams, PARAMS.model_copy(update={"candidates": ["int8"]}), models_dir=models)
        .builds["int8"]
        .inexact_kernel
        is None
    )
