"""evaluate@int8 on a real Ray cluster on loopback (executor.kind: ray, pipeline/on_ray.py; issue 31).

One cluster for the module: a head with no serving resource, and a second node started with
`ray start --address`, from a folder with no models/, that alone has the custom resource `quantgate_serving`;
object stores capped at 100 MB each (this machine has 24 GiB). The e2e project (tests/conftest.py) gives the
build, the eval sets and the local executor's scores of the same build. The cluster is stopped on every exit
path (the fixture's finally); no vLLM server outlives its task (quantgate.serving.orphan_guard).

Split by team, each document's score equals the local executor's exactly (the same server settings and
batches). Split by documents, a share batches other requests together and CPU arithmetic is not bit-stable
across batch shapes, so a near-tie can flip: the test allows 2 of the 12 documents' scores to differ and the
task score to move by at most 0.1.
"""

import contextlib
import json
import re
import shutil
import threading
import time
from pathlib import Path

import psutil
import pytest

from benchmarks.common import SERVING_RESOURCE as RESOURCE
from benchmarks.common import local_ray
from pipeline.evaluate import EvaluateParams, evaluate
from quantgate.errors import QuantgateError
from quantgate.executor import ExecutorParams, connect, disconnect
from quantgate.params import load_block
from quantgate.results import read_scores
from quantgate.serving import free_port

pytestmark = pytest.mark.e2e
BUILD = "int8"
TEAMS = ("billing", "search", "support")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head plus one serving node (benchmarks.common.local_ray), stopped on every exit path."""
    with local_ray(tmp_path_factory.mktemp("ray")) as ray:
        yield ray


def executor(cluster, tmp_path, **kw) -> ExecutorParams:
    values = {
        "kind": "ray",
        "address": cluster.address,
        "resources": {RESOURCE: 1},
        "replicas": 2,
        "max_retries": 0,
        "store": f"file://{tmp_path / 'store'}",
        "node_cache": str(tmp_path / "node-cache"),
    }
    return ExecutorParams(**{**values, **kw})


@pytest.fixture
def stage(project, tmp_path, monkeypatch):
    """The e2e project's evaluate block, run in the project with an empty evaluation cache (nothing comes
    from the local executor's cached scores)."""
    monkeypatch.chdir(project)
    monkeypatch.setattr("pipeline.team_scores.CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr("pipeline.on_ray.CACHE_DIR", tmp_path / "cache")
    return load_block("evaluate", EvaluateParams, project / "params.yaml")


def vllm_servers() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "vllm.entrypoints" in cmd and f"--served-model-name {BUILD} " in cmd:
            found.append(p)
    return found


def test_replicas_split_by_team_score_every_document_as_the_local_executor(cluster, project, stage, tmp_path):
    import ray

    out = tmp_path / "eval" / BUILD
    started = time.monotonic()
    docs = evaluate(BUILD, project / "models" / BUILD, project / "evals", out, stage, executor(cluster, tmp_path))
    wall = time.monotonic() - started
    print(f"\nray e2e: evaluate@{BUILD} with 2 replicas: {wall:.0f} s")
    assert sorted(docs) == sorted(TEAMS) and all(d.status == "ok" for d in docs.values()), {
        t: d.reason for t, d in docs.items()
    }
    (serving,) = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(RESOURCE)]  # the second node
    local = project / "results" / "eval" / BUILD
    for team in TEAMS:
        mine, theirs = read_scores(out / team / "scores.json"), read_scores(local / team / "scores.json")
        assert [(s.task, s.doc_id, s.score) for s in mine.samples] == [
            (s.task, s.doc_id, s.score) for s in theirs.samples
        ]
        assert mine.tasks == theirs.tasks and mine.cache_key == theirs.cache_key
        (where,) = mine.placement
        assert (where.executor, where.node_id, where.ip) == ("ray", serving["NodeID"], serving["NodeManagerAddress"])
        assert where.machine_kind == theirs.placement[0].machine_kind and where.vllm == theirs.serving.versions["vllm"]
    precision = json.loads((out / "precision.json").read_text())
    assert precision["executor"] == "ray" and precision["nodes"] == [serving["NodeManagerAddress"]]
    assert precision["dtype"] == json.loads((local / "precision.json").read_text())["dtype"]
    log = (out / "server.log").read_text()
    assert log.count("===== replica") == 2 and "Application startup complete" in log
    timing = json.loads((out / "timing.json").read_text())
    assert len(timing["replicas"]) == 2 and sorted(timing["scoring_s"]) == sorted(TEAMS)
    assert not (cluster.node_folder / "models").exists()  # the node fetched the build from the store
    assert list((tmp_path / "node-cache").iterdir()) and not vllm_servers()


def test_a_zero_shot_team_split_by_documents_over_two_servers(cluster, project, stage, tmp_path):
    evals = tmp_path / "evals"
    shutil.copytree(project / "evals" / "search", evals / "search")
    out = tmp_path / "eval" / BUILD
    docs = evaluate(BUILD, project / "models" / BUILD, evals, out, stage, executor(cluster, tmp_path))
    assert docs["search"].status == "ok", docs["search"].reason
    mine = read_scores(out / "search" / "scores.json")
    theirs = read_scores(project / "results" / "eval" / BUILD / "search" / "scores.json")
    assert [s.doc_id for s in mine.samples] == [s.doc_id for s in theirs.samples]  # each document once
    assert len(mine.placement) == 2  # scored on two servers
    same = sum(a.score == b.score for a, b in zip(mine.samples, theirs.samples, strict=True))
    (task,) = mine.tasks
    assert same >= len(mine.samples) - 2 and abs(mine.tasks[task].score - theirs.tasks[task].score) <= 0.1
    assert not vllm_servers()


def test_profile_runs_on_the_serving_node_and_names_it(cluster, project, tmp_path, monkeypatch):
    import ray

    from pipeline.profile import ProfileParams, profile_on_ray
    from quantgate.serving import ServeParams

    monkeypatch.chdir(tmp_path)  # the stage writes results/logs/ where it runs
    serve = load_block("evaluate.serve", ServeParams, project / "params.yaml")
    params = load_block("profile", ProfileParams, project / "params.yaml")
    p = profile_on_ray(BUILD, project / "models" / BUILD, serve, params, executor(cluster, tmp_path))
    assert p.status == "profiled", p.reason
    (serving,) = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(RESOURCE)]
    assert (p.placement.executor, p.placement.node_id) == ("ray", serving["NodeID"])
    assert sorted(p.loads) == sorted(f"c{c}" for c in params.concurrency) and p.kv_tokens > 0
    assert p.loads[f"c{params.concurrency[0]}"].output_tokens_per_s > 0
    assert "KV cache" in (tmp_path / "results" / "logs" / f"profile@{BUILD}.server.log").read_text()
    assert not vllm_servers()


def test_the_search_runs_its_ranking_and_screens_on_the_serving_node(cluster, project, tmp_path, monkeypatch):
    """The e2e project's search, scaled down to about a minute (1 conversation of 16 tokens to rank, looks of 4
    documents): run as one task on the serving node, its outs written here. Where vLLM cannot serve the
    search's scheme (W4A16 on an AVX2-only CPU) the node skips it with that reason, as the local stage does."""
    import ray
    import yaml

    from pipeline.search import SearchParams, search_on_ray, unservable
    from quantgate.recipes import load_recipe
    from quantgate.results import read_search

    monkeypatch.chdir(tmp_path)  # a project folder with what the stage reads, at the paths it reads them
    doc = yaml.safe_load((project / "params.yaml").read_text())
    doc["search"] |= {"looks": [4], "doc_budget": 60, "kl_samples": 1, "kl_seq_len": 16}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    for rel in (doc["search"]["recipe"], "results/calibration.jsonl"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(project / rel, tmp_path / rel)
    shutil.copytree(project / "evals", tmp_path / "evals")
    p = load_block("search", SearchParams)
    node = search_on_ray(
        project / "models" / "fp16", Path("evals"), Path("results/search"), p, executor(cluster, tmp_path)
    )
    (serving,) = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(RESOURCE)]
    assert node["node_id"] == serving["NodeID"]
    r = read_search(tmp_path / "results/search/search.json")
    with contextlib.chdir(project):  # what the local stage decides with the project's serving env
        unserved = unservable(p)
    if unserved:  # decided on the node, as here: e.g. no W4A16 kernel on an AVX2-only CPU
        assert r.skipped == f"vLLM here cannot serve it: {unserved}" and not r.screens
        assert "no layer kept 16-bit (search skipped" in (tmp_path / "results/search/recipe.yaml").read_text()
        return
    assert r.skipped is None and r.screens and r.docs_spent <= 60 and r.layers == len(r.sensitivity) > 100
    assert load_recipe(p.build, tmp_path / "results/search/recipe.yaml").modifiers
    assert f"{r.evaluations} screens" in (tmp_path / "results/search/recipe.yaml").read_text()


def test_a_cluster_that_does_not_answer_or_lacks_the_resource_is_one_line_before_any_server(cluster, tmp_path):
    with pytest.raises(QuantgateError) as err:
        connect(executor(cluster, tmp_path, address=f"127.0.0.1:{free_port()}"))
    assert "no Ray cluster answers" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(QuantgateError) as err:
        connect(executor(cluster, tmp_path, resources={"quantgate_gpu_serving": 1}))
    assert str(err.value).startswith(f"executor at {cluster.address}: no live node has what one task asks for")
    assert "quantgate_gpu_serving=1" in str(err.value) and "\n" not in str(err.value)
    disconnect()


def test_killing_the_only_serving_node_mid_task_fails_the_build_naming_the_node(cluster, project, stage, tmp_path):
    """Last in the module: it kills the only serving node. With max_retries 1 Ray would wait for ever for a
    node to run the task again; the stage sees that none can and fails the build with the dead node's name."""
    out = tmp_path / "eval" / BUILD
    killed = {}

    def kill_when_serving():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not killed:
            if vllm_servers():  # the server of the task is up: kill the node's raylet (its workers die with it)
                for p in psutil.process_iter(["cmdline"]):
                    if f"--node_manager_port={cluster.worker_port}" in " ".join(p.info["cmdline"] or []):
                        p.kill()
                        killed["at"] = time.monotonic()
            time.sleep(0.5)

    watcher = threading.Thread(target=kill_when_serving, daemon=True)
    watcher.start()
    docs = evaluate(
        BUILD,
        project / "models" / BUILD,
        project / "evals",
        out,
        stage,
        executor(cluster, tmp_path, replicas=1, max_retries=1),
    )
    watcher.join(timeout=5)
    assert killed, "the serving node was never killed"
    reasons = {d.reason for d in docs.values()}
    assert all(d.status == "error" for d in docs.values()) and len(reasons) == 1
    (reason,) = reasons
    assert re.match(r"the Ray node it ran on died \([\d.]+ \([0-9a-f]{12}\)\) and no live node", reason), reason
    assert "\n" not in reason
    assert reason.endswith(f"and no live node has CPU=1, {RESOURCE}=1 to run it again")
    for team in TEAMS:  # every team written, as an error the gate fails closed
        assert read_scores(out / team / "scores.json").status == "error"
    deadline = time.monotonic() + 30
    while vllm_servers() and time.monotonic() < deadline:  # the orphan guard kills the server's group
        time.sleep(1)
    assert not vllm_servers()
