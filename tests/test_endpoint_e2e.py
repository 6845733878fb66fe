"""Evaluation on a remote endpoint, end to end: a bare vLLM server that quantgate did not start
(`python -m vllm.entrypoints.openai.api_server`, the real default model, loopback) serves the fp16
build under the documented name `fp16@sha256:<weights_digest>`; the evaluate stage of a scratch project
with `evaluate.endpoints` scores it there and records the endpoint, and refuses the fp8 build pointed
at the same server before scoring. About 2 minutes on 2 CPU cores (one server start) after the e2e
project's `dvc repro`, whose fp16 and fp8 builds it links."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from benchmarks.common import project_env, scratch_project
from quantgate.serving import free_port, served_name
from tests.conftest import LIMIT, SERVE_PYTHON, run

pytestmark = pytest.mark.e2e
DOCS = 4  # docs per task: enough to show real scores, short for CI


@pytest.fixture(scope="module")
def deployment(project, tmp_path_factory):
    """(project, url, served name): a scratch project with the fp16 and fp8 builds of the e2e project
    (tests/conftest.py `project`, linked), and a vLLM server on loopback that serves fp16 as a deployment
    elsewhere would."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    root = scratch_project(
        tmp_path_factory.mktemp("endpoint") / "quantgate",
        limit=min(DOCS, LIMIT),
        params={
            "evaluate": {"endpoints": {b: {"url": url, "dtype": "float32", "timeout_s": 10.0} for b in ("fp16", "fp8")}}
        },
    )
    (root / "models").mkdir()
    for build in ("fp16", "fp8"):  # as the e2e project's stages made them (read only here)
        (root / "models" / build).symlink_to(project / "models" / build)
    digest = json.loads((root / "models/fp16/build.json").read_text())["weights_digest"]
    name = served_name("fp16", digest)
    # vLLM's ZMQ sockets and torch.distributed file store, removed after (short: a socket path has 108 bytes at most)
    ipc = tempfile.mkdtemp(prefix="qg-ipc-")
    env = dict(
        project_env(),
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_RPC_BASE_PATH=ipc,
        TMPDIR=ipc,
    )
    log = open(root / "deployment.log", "w")  # open for the server's life
    proc = subprocess.Popen(
        [SERVE_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(root / "models/fp16"),
         "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
         "--max-model-len", "2048", "--enforce-eager"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(2)
        assert proc.poll() is None, (root / "deployment.log").read_text()[-2000:]
        yield root, url, name
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()
        shutil.rmtree(ipc, ignore_errors=True)  # vLLM leaves its sockets behind


def test_a_build_is_scored_on_the_endpoint_that_serves_it(deployment):
    root, url, name = deployment
    out = run([sys.executable, "-m", "pipeline.evaluate", "fp16", "models/fp16", "evals", "results/eval/fp16"], root)
    assert f"evaluate[fp16]: {url} serves {name} (vLLM 0.32.0)" in out.stdout
    ev = root / "results/eval/fp16"
    assert not (ev / "server.log").exists()  # no server started here
    endpoint = json.loads((ev / "endpoint.json").read_text())
    assert (endpoint["url"], endpoint["served"], endpoint["max_model_len"]) == (url, name, 2048)
    assert endpoint["root"] == str(root / "models/fp16")
    precision = json.loads((ev / "precision.json").read_text())
    assert (precision["dtype"], precision["device"], precision["endpoint"]) == ("float32", "remote", url)
    for team in ("billing", "search", "support"):
        scores = json.loads((ev / team / "scores.json").read_text())
        assert scores["status"] == "ok" and scores["serving"]["endpoint"] == url
        assert len(scores["samples"]) == DOCS * len(scores["tasks"])
        assert all(s["score"] in (0.0, 1.0) for s in scores["samples"])


def test_the_endpoint_refuses_another_build_before_scoring(deployment):
    root, url, name = deployment
    fp8 = json.loads((root / "models/fp8/build.json").read_text())["weights_digest"]
    started = time.monotonic()
    out = run(
        [sys.executable, "-m", "pipeline.evaluate", "fp8", "models/fp8", "evals", "results/eval/fp8"], root, check=False
    )
    assert out.returncode == 2 and time.monotonic() - started < 60
    assert out.stderr.strip().splitlines()[-1] == (
        f"quantgate: error: evaluate.endpoints.fp8: {url} serves {name}; expected {served_name('fp8', fp8)} "
        "(vLLM --served-model-name); refused before scoring"
    )
    assert not (root / "results/eval/fp8").exists()
