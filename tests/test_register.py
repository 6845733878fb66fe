"""The register stage against a real MLflow sqlite store in a temp dir, with tiny builds."""

import json

import pytest

from pipeline.register import RegisterParams, register
from quantgate.errors import QuantgateError
from quantgate.results import BuildGate, GateResult, TeamComparison, TeamSummary
from registry import store
from tests.tiny import tiny_llama_dir


def gate_result(verdicts: dict[str, str]) -> GateResult:
    def search(verdict: str) -> TeamComparison:
        return TeamComparison(
            verdict=verdict,
            metric="acc",
            delta=0.0,
            lower=-0.01,
            upper=0.02,
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
        with pytest.raises(QuantgateError, match=r"params.yaml:2: register.model_name: String should"):
            load_block("register", RegisterParams, params)
