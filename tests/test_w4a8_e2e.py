"""The W4A8 build (quantize.<build>.w4a8) end to end on the real model, in a light copy of the e2e project of
tests/conftest.py with int4-w4a8 added (int4's block plus `w4a8: true`), each stage run as dvc.yaml runs it:
validate passes it, quantize copies int4's weights and records `w4a8: true` and scheme W4A8, and then
- on a machine where vLLM would serve those weights as W4A16 (no AMX: every kind but AMX, and GPUs), evaluate
  and profile refuse it before any server starts with that reason, the gate FAILs it closed with it, and
  register records a run tagged w4a8=true without a version: what is gated is what is served;
- on an AMX CPU whose probe's W4A8 call answered, it is served (VLLM_CPU_INT4_W4A8=1), scored and profiled as a
  build of its own, not from int4's cache.
About 2 minutes where it is refused (imports and the registry), more on AMX (a server start and the scoring)."""

import json
import subprocess
import sys

import pytest
import yaml

from benchmarks.common import project_env
from quantgate.precision import probe, resolve_dtype, w4a8_problem
from tests.conftest import SERVE_PYTHON, light_copy, registered_in_copy, run

pytestmark = pytest.mark.e2e
BUILD = "int4-w4a8"


def stage(argv: list[str], cwd) -> str:
    """Run one stage's command in `cwd`; its output, asserting that it succeeded."""
    out = subprocess.run(argv, cwd=cwd, env=project_env(), capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return out.stdout + out.stderr


def test_int4s_weights_served_as_w4a8_are_a_build_of_their_own_gated_as_served(project, tmp_path):
    work = light_copy(project, tmp_path / "p", link_each_model=True)
    doc = yaml.safe_load((work / "params.yaml").read_text())
    doc["builds"].append(BUILD)
    doc["quantize"][BUILD] = {**doc["quantize"]["int4"], "w4a8": True}
    (work / "params.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    platform = probe(SERVE_PYTHON)
    dtype, _ = resolve_dtype(doc["evaluate"]["serve"]["dtype"], platform)
    refusal = w4a8_problem(platform, dtype)

    stage([sys.executable, "-m", "pipeline.validate", "evals", "results/teams.json"], work)
    said = stage([sys.executable, "-m", "pipeline.quantize", BUILD, "models/fp16", f"models/{BUILD}"], work)
    assert "its weights are copied, not quantized again" in said
    manifest = json.loads((work / "models" / BUILD / "build.json").read_text())
    int4 = json.loads((work / "models/int4/build.json").read_text())
    assert (manifest["scheme"], manifest["w4a8"], manifest["weights_digest"]) == ("W4A8", True, int4["weights_digest"])

    out = f"results/eval/{BUILD}"
    said = stage([sys.executable, "-m", "pipeline.evaluate", BUILD, f"models/{BUILD}", "evals", out], work)
    docs = {t: json.loads((work / out / t / "scores.json").read_text()) for t in ("billing", "search", "support")}
    said += stage(
        [sys.executable, "-m", "pipeline.profile", BUILD, f"models/{BUILD}", "evals", f"results/profile/{BUILD}.json"],
        work,
    )
    profile = json.loads((work / f"results/profile/{BUILD}.json").read_text())
    run(yaml.safe_load((work / "dvc.yaml").read_text())["stages"]["gate"]["cmd"], work)
    gate = json.loads((work / "results/gate.json").read_text())["builds"][BUILD]
    if refusal:  # every kind but AMX: refused before any server, with the reason that holds here
        print(f"\ne2e: {BUILD} refused here ({platform.kind}): {refusal}")
        reason = docs["billing"]["reason"]
        assert "vLLM cannot serve the W4A8 build" in reason and refusal in reason, reason
        assert all((d["status"], d["reason"]) == ("error", reason) for d in docs.values())
        assert not (work / out / "server.log").exists() and "vLLM server ready" not in said
        assert profile["status"] == "unprofiled" and refusal in profile["reason"]
        assert gate["verdict"] == "FAIL" and all(refusal in t["reason"] for t in gate["teams"].values())
    else:  # AMX: served as W4A8 and scored as a build of its own (int4's cached scores are not its scores)
        print(f"\ne2e: {BUILD} served here ({platform.kind}); gate {gate['verdict']}")
        assert all(d["status"] == "ok" for d in docs.values()), [d.get("reason") for d in docs.values()]
        assert profile["status"] == "profiled"
        # one server: evaluate's measured the build before scoring it, and the profile stage started none
        assert profile["measured_on"] == f"evaluate@{BUILD}" and f"profile[{BUILD}]: from cache" in said
    assert (gate.get("same_weights_as"), gate.get("served_with")) == ("int4", {"w4a8": "true"})

    # register, in a registry of the copy's own: the run says how the build is served
    with registered_in_copy(work, BUILD) as (registered, client):
        entry = registered["builds"].get(BUILD) or registered["unregistered"][BUILD]
        tags = client.get_run(entry["run_id"]).data.tags
        assert (tags["w4a8"], tags["scheme"], tags["same_weights_as"]) == ("true", "W4A8", "int4")
        if refusal:
            assert BUILD in registered["unregistered"] and entry["verdict"] == "FAIL"
