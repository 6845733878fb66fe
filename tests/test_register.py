"""The register stage against a real MLflow sqlite store in a temp dir, with tiny builds."""

import json
from pathlib import Path

import pytest

from pipeline.gate import GateParams, gate, report, same_weights_note, served_apart
from pipeline.register import RegisterParams, register
from quantgate.errors import QuantgateError
from quantgate.results import (
    SEARCH_RESULT,
    BuildGate,
    GateResult,
    Screen,
    SearchResult,
    TeamComparison,
    TeamSummary,
    write_gate,
    write_search,
)
from quantgate.teams import load_teams
from registry import store
from tests.conftest import safetensors_build, write_scores
from tests.tiny import tiny_llama_dir

BOUNDS = {"PASS": (-0.01, 0.02), "FAIL": (0.06, 0.09), "INCONCLUSIVE": (-0.01, 0.08)}  # the drop's, margin 0.05


def gate_result(verdicts: dict[str, str]) -> GateResult:
    """A gate result with one team, search, at each build's verdict: bounds and margin that give that verdict."""

    def search(verdict: str) -> TeamComparison:
        lower, upper = BOUNDS[verdict]
        return TeamComparison(
            verdict=verdict,
            metric="acc",
            delta=0.0,
            margin=0.05,
            lower=lower,
            upper=upper,
            recovery_pct=100.0,
            baseline=0.9,
            candidate=0.9,
            reason="test",
        )

    return GateResult(
        baseline="fp16",
        precision=None,
        builds={
            b: BuildGate(verdict=v, shippable=v == "PASS", teams={"search": search(v)}) for b, v in verdicts.items()
        },
    )


def team_summary(sha256: str) -> TeamSummary:
    """A results/teams.json entry for team `search` with eval-set digest `sha256`."""
    return TeamSummary(
        owner="Search",
        contact="search@example.com",
        metric="acc",
        higher_is_better=True,
        margin={"absolute": 0.05},
        confidence=0.95,
        n_docs=200,
        min_docs=56,
        tasks={"search_qa": 200},
        sha256=sha256,
    )


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "params.yaml").write_text("register: {}\n")
    models = tmp_path / "models"
    for seed, build in enumerate(("fp16", "int4", "fp8")):
        tiny_llama_dir(models / build, seed=seed)
        m = json.loads((models / build / "build.json").read_text())
        (models / build / "build.json").write_text(json.dumps({**m, "build": build}))
    (tmp_path / "results/eval").mkdir(parents=True)
    return tmp_path


TEAMS = {"search": team_summary("ab" * 32)}


def test_registers_passing_builds_and_logs_the_others_as_runs(workdir):
    params = RegisterParams(model_name="tiny", experiment="e")
    plot = workdir / "results/gate_recovery.png"
    plot.write_bytes(b"\x89PNG fake")
    (workdir / "results/eval/fp8/search").mkdir(parents=True)
    (workdir / "results/eval/fp8/search/scores.json").write_text('{"status": "ok"}')
    out = register(
        workdir / "models",
        gate_result({"int4": "PASS", "fp8": "FAIL"}),
        "# report",
        workdir / "results/eval",
        params,
        TEAMS,
        [plot],
    )
    client = store.client()
    versions = {mv.tags["build"]: mv for mv in client.search_model_versions("name='tiny'")}
    assert set(versions) == {"fp16", "int4"} == set(out["builds"])  # the FAIL build is not a version
    assert versions["int4"].tags["gate.verdict"] == "PASS" and versions["int4"].tags["gate.search.verdict"] == "PASS"
    assert versions["fp16"].tags["gate.verdict"] == "BASELINE"
    assert client.get_model_version_by_alias("tiny", "fallback").version == versions["fp16"].version
    # the FAIL build is a run with all its evidence, the same tags a version run gets
    fp8 = out["unregistered"]["fp8"]
    assert (fp8["verdict"], fp8["reused"]) == ("FAIL", False) and list(out["unregistered"]) == ["fp8"]
    run = client.get_run(fp8["run_id"])
    assert run.data.params["gate.verdict"] == "FAIL" and run.data.tags["gate.search.verdict"] == "FAIL"
    assert run.data.tags["gate.search.team_sha256"] == "ab" * 32 and run.data.tags["quantgate.model"] == "tiny"
    assert len(run.data.tags["weights_sha256"]) == 64 and run.data.tags["recipe"]
    int4_run = client.get_run(out["builds"]["int4"]["run_id"]).data.tags
    assert {k for k in int4_run if not k.startswith("mlflow.")} == {
        k for k in run.data.tags if not k.startswith("mlflow.")
    }
    artifacts = {f.path for f in client.list_artifacts(fp8["run_id"])}
    assert {"gate_report.md", "gate_recovery.png", "model", "evidence"} <= artifacts
    assert client.search_model_versions(f"run_id='{fp8['run_id']}'") == []
    # same weights and evidence again: no duplicate versions, no duplicate runs
    again = register(
        workdir / "models",
        gate_result({"int4": "PASS", "fp8": "FAIL"}),
        "# report",
        workdir / "results/eval",
        params,
        TEAMS,
    )
    assert again["builds"]["int4"] == {**out["builds"]["int4"], "reused": True}
    assert again["unregistered"]["fp8"] == {**fp8, "reused": True}
    assert len(client.search_model_versions("name='tiny'")) == 2
    assert len(client.search_runs([client.get_experiment_by_name("e").experiment_id])) == 3


def test_a_build_scored_through_an_inexact_int8_kernel_is_tagged_so_on_its_version_and_in_status(workdir):
    """gate.json's inexact_kernel was in the gate line and the report only: a release manager approving in the
    MLflow UI did not see that the scores hold the kernel's error."""
    from registry.status import status_lines

    wrong = "wrong output [0.2529] (expected 32)"
    result = gate_result({"int4": "PASS", "fp8": "FAIL"})
    result.builds["int4"] = result.builds["int4"].model_copy(update={"inexact_kernel": wrong})
    args = (
        workdir / "models",
        result,
        "# r",
        workdir / "results/eval",
        RegisterParams(model_name="tiny", experiment="e"),
    )
    register(*args, TEAMS)
    client = store.client()
    found = {mv.tags["build"]: mv.tags for mv in client.search_model_versions("name='tiny'")}
    assert found["int4"]["gate.inexact_kernel"] == wrong and "gate.inexact_kernel" not in found["fp16"]
    assert found["int4"]["gate.verdict"] == "PASS"  # the note is a fact beside the verdict, not a verdict
    lines = status_lines(client, "tiny")
    assert [line.split()[1] for line in lines if "inexact-int8-kernel" in line] == ["int4"]
    # a note, not evidence: brought up to date on the reused version (a gate that no longer finds it drops it)
    result.builds["int4"] = result.builds["int4"].model_copy(update={"inexact_kernel": None})
    again = register(*args, TEAMS)  # the same result object, its int4 gate now without the note
    assert again["builds"]["int4"]["reused"]
    mv = client.get_model_version("tiny", again["builds"]["int4"]["version"])
    assert "gate.inexact_kernel" not in mv.tags
    assert "gate.inexact_kernel" not in client.get_run(again["builds"]["int4"]["run_id"]).data.tags


def test_tampered_weights_refused_before_anything_is_written(workdir):
    with open(workdir / "models/int4/model.safetensors", "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\x00" * 8)
    with pytest.raises(QuantgateError, match="int4/model.safetensors: sha256 does not match build.json"):
        register(
            workdir / "models",
            gate_result({"int4": "PASS"}),
            "# r",
            workdir / "results/eval",
            RegisterParams(model_name="tiny", experiment="e"),
            TEAMS,
        )
    client = store.client()
    assert client.search_registered_models() == []


def test_a_blank_model_name_is_refused_at_load_naming_the_field(tmp_path):
    """It reached MLflow as "MlflowException: Missing value for required parameter 'name'"."""
    from quantgate.errors import QuantgateError
    from quantgate.params import load_block

    params = tmp_path / "params.yaml"
    for blank in ("''", "'  '"):
        params.write_text(f"register:\n  model_name: {blank}\n")
        with pytest.raises(QuantgateError, match=r"params.yaml:2: register.model_name: must not be empty or blank"):
            load_block("register", RegisterParams, params)


def gate_twins(root: Path, evals: Path, search: SearchResult, w4a8: bool = False) -> GateResult:
    """The real gate on int4 and int4-mixed made from one set of weights (one seed), scored alike on a set too
    small to decide (INCONCLUSIVE for both teams' rows), after the search stage's result `search`; with
    `w4a8`, int4-mixed's build.json says it is served as W4A8 (quantize.<build>.w4a8)."""
    for build, seed in (("fp16", 0), ("int4", 1), ("int4-mixed", 1)):
        safetensors_build(root / "models" / build, build, seed, shards=1)
        write_scores(root / "results/eval", build, "search", [1.0, 0.0] * 5)
    if w4a8:
        manifest = root / "models/int4-mixed/build.json"
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "w4a8": True, "scheme": "W4A8"}))
    write_search(root / SEARCH_RESULT, search)
    teams = [t for t in load_teams(evals) if t.name == "search"]
    params = GateParams(baseline="fp16", candidates=["int4", "int4-mixed"], bootstrap_resamples=1000)
    return gate(root / "results/eval", teams, params, root / SEARCH_RESULT, root / "models")


@pytest.fixture
def registry_dir(tmp_path, monkeypatch):
    """An empty project folder holding the registry (sqlite, cwd) and params.yaml."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "params.yaml").write_text("register: {}\n")
    return tmp_path


# the e2e project on an AMX CPU: the search kept none of 210 layers and screened nothing that passed
KEPT_NONE_FAILED = SearchResult(
    build="int4-mixed",
    recipe="recipes/int4.yaml",
    passed=False,
    chosen=0,
    layers=210,
    evaluations=2,
    screens=[
        Screen(kept=k, outcome="fail", passed=False, worst_slack=-0.1, teams={}, effective_bits=b, seconds=1.0)
        for k, b in ((0, 4.25), (32, 5.98))
    ],
    max_bits_per_weight=6.0,
)


def runs_by_build(client) -> dict:
    """{build: [its runs]} in experiment `e`."""
    found: dict = {}
    for run in client.search_runs([client.get_experiment_by_name("e").experiment_id]):
        found.setdefault(run.data.tags["build"], []).append(run)
    return found


def test_a_w4a8_build_of_int4s_weights_is_said_to_be_served_otherwise(registry_dir, example_evals):
    """int4-w4a8 (quantize.<build>.w4a8) copies int4's weights: the gate line must not read as if it were
    int4, so the note names what its servers set that int4's do not."""
    result = gate_twins(registry_dir, example_evals, KEPT_NONE_FAILED, w4a8=True)
    w4a8 = result.builds["int4-mixed"]
    assert w4a8.served_with == {"w4a8": "true"} and result.builds["int4"].served_with is None
    assert "served_with" not in result.builds["int4"].dump()
    assert same_weights_note("int4-mixed", w4a8, None) == "same weights as int4, served with w4a8=true"
    assert "  - same weights as int4 (the search kept no layer 16-bit), served with w4a8=true\n" in report(
        result, search=KEPT_NONE_FAILED
    )
    # listed the other way round (the W4A8 build first), int4's line says what it is served without
    assert served_apart(registry_dir / "models/int4", registry_dir / "models/int4-mixed") == {"w4a8": "false"}
    assert served_apart(registry_dir / "models/int4", registry_dir / "models/int4") == {}


def test_report_of_another_projects_gate_reads_that_projects_search(registry_dir, example_evals):
    """`quantgate report --gate-json other/results/gate.json` read ./results/search/search.json, the search of the
    project it ran in (none here), so the note said less than that project's own report."""
    from click.testing import CliRunner

    from cli.main import cli

    other = registry_dir / "other"
    write_gate(other / "results/gate.json", gate_twins(other, example_evals, KEPT_NONE_FAILED))
    result = CliRunner().invoke(cli, ["report", "--gate-json", "other/results/gate.json"])
    assert result.exit_code == 0, result.output
    assert "same weights as int4 (the search kept no layer 16-bit)" in result.output
    assert not (registry_dir / "results").exists()


def test_two_builds_with_one_set_of_weights_keep_a_run_each_with_their_own_verdict(registry_dir, example_evals):
    """The search kept no layer, so int4-mixed is int4's weights with int4's evidence, but the gate FAILs it
    (its search found nothing) and calls int4 INCONCLUSIVE: register stopped on "recorded gate.verdict=
    INCONCLUSIVE but the gate now says FAIL for the same weights and evidence"."""
    result = gate_twins(registry_dir, example_evals, KEPT_NONE_FAILED)
    int4, mixed = result.builds["int4"], result.builds["int4-mixed"]
    assert (int4.verdict, mixed.verdict) == ("INCONCLUSIVE", "FAIL")
    assert int4.teams == mixed.teams  # the same per-team evidence
    assert mixed.reason.startswith("none of the search's 2 screened candidates (0, 32 layers kept 16-bit; at most 6")
    assert (int4.same_weights_as, mixed.same_weights_as) == (None, "int4")
    assert mixed.served_with is None  # served alike: the note says nothing of serving
    assert "same_weights_as" not in int4.dump() and mixed.dump()["same_weights_as"] == "int4"
    md = report(result, search=KEPT_NONE_FAILED)
    assert "- **int4-mixed**: FAIL (not shippable)\n  - none of the search's 2 screened" in md
    assert "  - same weights as int4 (the search kept no layer 16-bit)\n" in md and md.count("same weights as") == 1
    skipped = SearchResult(build="int4-mixed", recipe="recipes/int4.yaml", skipped="vLLM here cannot serve it: ...")
    assert (
        same_weights_note("int4-mixed", mixed, skipped)
        == "same weights as int4 (its search was skipped: no layer kept 16-bit)"
    )
    assert same_weights_note("int4-mixed", mixed, None) == "same weights as int4"
    assert same_weights_note("int4", int4, KEPT_NONE_FAILED) is None

    params = RegisterParams(model_name="tiny", experiment="e")
    args = (registry_dir / "models", result, "# report", registry_dir / "results/eval", params, TEAMS)
    out = register(*args)
    assert out["builds"].keys() == {"fp16"} and list(out["unregistered"]) == ["int4", "int4-mixed"]
    client = store.client()
    found = runs_by_build(client)
    assert {b: len(r) for b, r in found.items()} == {"fp16": 1, "int4": 1, "int4-mixed": 1}
    (r4,), (rm,) = found["int4"], found["int4-mixed"]
    assert r4.data.tags["weights_sha256"] == rm.data.tags["weights_sha256"]
    assert r4.data.tags["evidence_sha256"] == rm.data.tags["evidence_sha256"]
    assert (r4.data.params["gate.verdict"], rm.data.params["gate.verdict"]) == ("INCONCLUSIVE", "FAIL")
    assert (r4.data.tags["gate.verdict"], rm.data.tags["gate.verdict"]) == ("INCONCLUSIVE", "FAIL")
    assert rm.data.tags["same_weights_as"] == "int4" and "same_weights_as" not in r4.data.tags
    assert {b: e["run_id"] for b, e in out["unregistered"].items()} == {
        "int4": r4.info.run_id,
        "int4-mixed": rm.info.run_id,
    }
    from registry.status import status_lines

    lines = status_lines(client, "tiny")
    assert any(f"run {rm.info.run_id}" in line and line.endswith("same-weights-as=int4") for line in lines)
    assert not any(f"run {r4.info.run_id}" in line and "same-weights-as" in line for line in lines)

    again = register(*args)  # dvc repro again: both runs reused, no duplicate
    assert again["unregistered"] == {b: {**e, "reused": True} for b, e in out["unregistered"].items()}
    assert {b: len(r) for b, r in runs_by_build(client).items()} == {"fp16": 1, "int4": 1, "int4-mixed": 1}
    assert [mv.tags["build"] for mv in client.search_model_versions("name='tiny'")] == ["fp16"]  # the only version

    # int4-mixed's weights are its own again (its gate says so): the note goes, the runs stay
    apart = result.model_copy(
        update={"builds": {**result.builds, "int4-mixed": mixed.model_copy(update={"same_weights_as": None})}}
    )
    register(registry_dir / "models", apart, "# report", registry_dir / "results/eval", params, TEAMS)
    assert "same_weights_as" not in client.get_run(rm.info.run_id).data.tags


def test_a_run_registered_before_the_build_was_in_the_lookup_is_reused(registry_dir, example_evals):
    """An older registry holds int4's run (same weights and evidence as int4-mixed's now): int4 reuses it
    as before, int4-mixed gets a run of its own, and int4's verdict stays what it recorded."""
    result = gate_twins(registry_dir, example_evals, KEPT_NONE_FAILED)
    params = RegisterParams(model_name="tiny", experiment="e")
    only_int4 = result.model_copy(update={"builds": {"int4": result.builds["int4"]}})
    before = register(registry_dir / "models", only_int4, "# r", registry_dir / "results/eval", params, TEAMS)
    out = register(registry_dir / "models", result, "# r", registry_dir / "results/eval", params, TEAMS)
    assert out["unregistered"]["int4"] == {**before["unregistered"]["int4"], "reused": True}
    mixed = out["unregistered"]["int4-mixed"]
    assert (mixed["verdict"], mixed["reused"]) == ("FAIL", False) and mixed["run_id"] != out["unregistered"]["int4"][
        "run_id"
    ]
    client = store.client()
    assert client.get_run(before["unregistered"]["int4"]["run_id"]).data.params["gate.verdict"] == "INCONCLUSIVE"


def test_a_builds_serving_settings_are_tagged_and_a_build_without_them_gets_none():
    from registry.tags import lineage_tags

    manifest = {
        "build": "int4-w4a8",
        "scheme": "W4A8",
        "dtype": "bfloat16",
        "weights_digest": "d" * 64,
        "weights": {"model.safetensors": "d" * 64},
        "base_model": {"id": "m", "sha256": "0" * 64},
        "recipe": {"file": "recipes/int4.yaml"},
    }
    plain = lineage_tags(manifest, {})
    assert "w4a8" not in plain and "kv_cache_dtype" not in plain and plain["scheme"] == "W4A8"
    served = lineage_tags(manifest | {"w4a8": True, "kv_cache_dtype": "fp8"}, {})
    assert (served["w4a8"], served["kv_cache_dtype"]) == ("true", "fp8")
