"""The canary fleet end to end: real vLLM servers on loopback, the default model's builds from
the shared `dvc repro` (tests/conftest.py `project`), the real MLflow registry of that run.

Servers are started once (from verified registry artifacts) and reused by every canary here:
the stable fp16 build, the good candidate (int4 where vLLM can serve W4A16, else int8), and a
deliberately broken build (embedding rows permuted: it loads and answers, with garbage).
Tests run in order: promote the good build, roll back under load, abort the broken build on
shadow agreement, abort a good build whose server is killed mid-canary.
"""

import json
import math
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from pytest import MonkeyPatch

from tests.conftest import REPO, approved_version, run, w4a16_servable
from tests.policies import fast_policy, fast_router

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
GOOD = "int4" if w4a16_servable() else "int8"  # int8: served on every kind; fp8 is too slow on CPUs
LOAD_RPS, MAX_TOKENS = 1.5, 3


def e2e_topology():
    """params.yaml's canary_topology with the router on a free port."""
    from canary.policy import RouterAddress, load_topology

    return load_topology(REPO / "params.yaml").model_copy(update={"router": RouterAddress(port=0)})


def permute_embeddings(src: Path, dst: Path) -> None:
    """Copy build `src` to `dst` with the token embedding rows shuffled (tied lm_head follows)."""
    import torch
    from safetensors.torch import load_file, save_file

    from quantgate.manifest import read_manifest, write_manifest

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if name.endswith("embed_tokens.weight"):
                tensors[name] = t[torch.randperm(t.shape[0], generator=torch.Generator().manual_seed(0))].contiguous()
        save_file(tensors, f, metadata={"format": "pt"})
    m = read_manifest(src)
    write_manifest(
        dst,
        build="broken",
        scheme=m["scheme"],
        dtype=m["dtype"],
        base_model=m["base_model"],
        recipe={"corruption": "embedding rows permuted (test build)"},
    )


class Load:
    """Open-loop greedy load through a router in a thread, prompts from the team eval sets;
    records (sent, done, ok, backend label) per request."""

    def __init__(self, url: str, rps: float = LOAD_RPS):
        from canary.load import prompts_from_evals

        self.url, self.rps, self.results, self._stop = url, rps, [], threading.Event()
        # interleaved by team (billing, search, support, billing, ...): every step sees the whole set's mix. In team
        # order a step could fall on one team's prompts only: int4 agrees with fp16 on 9 of 10 billing prompts'
        # first 3 tokens and 1 of 10 support ones (0.57 over the set; AMX Xeon, 2026-12-06), so a step 4 of
        # support prompts aborted a good canary at agreement 0.08 (n=12), depending on how fast earlier steps ran
        ordered = prompts_from_evals(REPO / "evals", limit=10)  # task by task, 10 each (every task has 10+)
        self.prompts = [
            p for group in zip(*(ordered[i : i + 10] for i in range(0, len(ordered), 10)), strict=True) for p in group
        ]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._workers: list[threading.Thread] = []

    def _one(self, i: int) -> None:
        sent = time.time()
        stream = i % 2 == 1  # chat, as the teams' users send it (the model is an instruct model)
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": self.prompts[i % len(self.prompts)]}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": stream,
        }
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=300) as r:
                text = r.read().decode()
                ok = (
                    r.status_code == 200 and ("[DONE]" in text if stream else "choices" in text) and "error" not in text
                )
                label, status = r.headers.get("x-canary-backend"), r.status_code
                role = f"{r.headers.get('x-canary-role')} retried={r.headers.get('x-canary-retried')}"
        except httpx.HTTPError as exc:
            ok, label, status, role, text = False, None, None, None, type(exc).__name__
        self.results.append(
            {
                "sent": sent,
                "done": time.time(),
                "ok": ok,
                "backend": label,
                "status": status,
                "role": role,
                "stream": stream,
                "detail": "" if ok else text[-300:],
            }
        )

    def _run(self) -> None:
        i = 0
        while not self._stop.wait(1.0 / self.rps):
            w = threading.Thread(target=self._one, args=(i,), daemon=True)
            w.start()
            self._workers.append(w)
            i += 1

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for w in self._workers:
            w.join(timeout=300)

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.results if not r["ok"]]


def register_broken(project: Path, client) -> str:
    """The version of the broken build (models/fp16 with its embedding rows permuted), approved by
    a recorded override: the one already in `project`'s registry (tag build=broken), else registered
    now from the project (register() reads its params.yaml, git and registry: cwd and
    MLFLOW_TRACKING_URI are set to the project's for the call and restored after)."""
    from registry import approval

    found = [
        int(mv.version) for mv in client.search_model_versions(f"name='{MODEL}'") if mv.tags.get("build") == "broken"
    ]
    if found:
        version = str(max(found))
        assert approval.approval_of(client, MODEL, version).approved
        return version
    with MonkeyPatch.context() as mp:
        mp.chdir(project)
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'mlflow.db'}")
        return _register_broken(project, client)


def _register_broken(project: Path, client) -> str:
    from pipeline.register import RegisterParams, register
    from quantgate.params import load_block
    from quantgate.results import BuildGate, GateResult, TeamComparison, read_teams

    if not (project / "models/broken").is_dir():
        permute_embeddings(project / "models/fp16", project / "models/broken")
    search = TeamComparison(verdict="FAIL", metric="acc", reason="deliberately broken test build, never evaluated")
    out = register(
        project / "models",
        GateResult(
            baseline="fp16",
            precision=None,
            builds={"broken": BuildGate(verdict="FAIL", shippable=False, teams={"search": search})},
        ),
        "# broken test build",
        project / "results/eval",
        load_block("register", RegisterParams, project / "params.yaml"),
        read_teams(project / "results/teams.json"),
    )
    assert out["builds"]["fp16"]["reused"]
    n_docs = json.loads((project / "results/teams.json").read_text())["search"]["n_docs"]
    return approved_version(client, MODEL, "broken", out["unregistered"]["broken"], n_docs)


@pytest.fixture(scope="module")
def fleet(project, tmp_path_factory):
    """Registry client, versions, and running servers {version: Backend} for fp16, GOOD and broken."""
    from canary.local import LocalServers
    from quantgate.params import load_block
    from quantgate.serving import ServeParams
    from registry import store

    cwd = os.getcwd()
    os.chdir(project)  # register() and lineage read params.yaml / git of the project
    uri = f"sqlite:///{project / 'mlflow.db'}"
    client = store.client(uri)
    os.environ["MLFLOW_TRACKING_URI"] = uri
    reg = json.loads((project / "results/registry.json").read_text())
    n_docs = json.loads((project / "results/teams.json").read_text())["search"]["n_docs"]
    v = {
        "fp16": str(reg["builds"]["fp16"]["version"]),
        GOOD: approved_version(client, MODEL, GOOD, reg["builds"].get(GOOD) or reg["unregistered"][GOOD], n_docs),
        "broken": register_broken(project, client),
    }
    assert v["broken"] not in (v["fp16"], v[GOOD])
    serve = load_block("evaluate.serve", ServeParams)
    started = time.monotonic()
    with LocalServers(client, MODEL, serve, e2e_topology().servers, tmp_path_factory.mktemp("fleet")) as f:
        # started side by side: most of a start is three processes importing vLLM one after the other (about
        # 40 s on 2 cores), so three at once take about 60 s instead of 116
        with ThreadPoolExecutor(3) as pool:
            starts = [
                pool.submit(f.start, v[build], role)
                for build, role in (("fp16", "stable"), (GOOD, "candidate"), ("broken", "candidate"))
            ]
        for done in starts:
            done.result()  # a start that failed fails the fixture with its reason
        print(f"\nfleet: 3 vLLM servers verified and started in {time.monotonic() - started:.0f} s")
        yield {
            "client": client,
            "v": v,
            "fleet": f,
            "reuse": {ver: f.backends[ver].url for ver in v.values()},
            "serve": serve,
        }
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    os.chdir(cwd)


def canary(fleet, build: str, policy, tmp_path, kill_after_s: float | None = None):
    """run_canary for `build` with the fleet's servers, under Load; returns (outcome, load, log lines)."""
    from canary.controller import Hooks, Local, run_canary

    lines, load = [], []

    def on_router(url: str):
        load.append(Load(url).__enter__())
        if kill_after_s is not None:
            pid = fleet["fleet"].pids[fleet["v"][build]]
            threading.Timer(kill_after_s, lambda: os.killpg(pid, signal.SIGKILL)).start()
        return lambda: load[0].__exit__(None, None, None)

    def log(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    local = Local(fleet["serve"], tmp_path, e2e_topology(), fast_router(), fleet["reuse"])
    outcome = run_canary(
        fleet["client"], MODEL, fleet["v"][build], policy, "e2e-test", local, Hooks(log, on_router=on_router)
    )
    return outcome, load[0], lines


def test_good_build_goes_through_every_step_and_is_promoted(fleet, tmp_path):
    from registry import aliases, audit

    client, v = fleet["client"], fleet["v"]
    policy = fast_policy()
    started = time.monotonic()
    outcome, load, lines = canary(fleet, GOOD, policy, tmp_path)
    print(
        f"\ncanary {GOOD}: {outcome.decision} after {time.monotonic() - started:.0f} s, {len(load.results)} requests, "
        f"{len(load.failed)} failed"
    )
    assert outcome.decision == "promoted", outcome.reason
    assert outcome.step == len(policy.steps) == 4
    assert not load.failed, load.failed[:3]
    now = aliases.current(client, MODEL)
    assert now["production"] == v[GOOD] and now["previous"] == v["fp16"] and "candidate" not in now
    history = client.get_metric_history(outcome.run_id, "weight_pct")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == policy.steps
    assert any(line.startswith("step 4 (100%): shadow_agreement") for line in lines)
    promoted = [e for e in audit.history(client, MODEL) if e.action == "promote" and e.alias == "production"]
    assert promoted[-1].canary_run_id == outcome.run_id and promoted[-1].to_version == v[GOOD]


def test_rollback_under_load_moves_traffic_at_the_next_resolve(fleet, project):
    """Every request that reaches the router after its first registry read that began after the alias flip
    goes to the previous version, and none fails. How many seconds that takes (resolve_interval_s + one
    registry read; longer on a loaded CI machine) is printed, not asserted: benchmarks/gateway.py measures it."""
    from gateway.router import Router
    from gateway.server import RouterServer
    from registry import aliases, audit

    client, v = fleet["client"], fleet["v"]
    assert aliases.current(client, MODEL)["production"] == v[GOOD]
    router = Router(fleet["fleet"].resolver(v["fp16"]), fast_router(), model_name=MODEL)
    with RouterServer(router) as server, Load(server.url) as load:
        time.sleep(6)
        p = run(["quantgate", "rollback", MODEL, "--by", "e2e-test", "--reason", "e2e: rollback under load"], project)
        assert f"production: v{v[GOOD]} -> v{v['fp16']}" in p.stdout
        time.sleep(6)
    event = [e for e in audit.history(client, MODEL) if e.action == "rollback" and e.alias == "production"][-1]
    flip = event.done_at.timestamp()  # the aliases are written (audit run ended); `at` is the request
    fresh = next((finished for started, finished in router.resolves if started >= flip), None)
    assert fresh is not None, "the router did not read the registry after the alias flip"
    after = sorted((r for r in load.results if r["sent"] >= fresh), key=lambda r: r["sent"])
    first_prev = next(
        (r["sent"] for r in load.results if r["sent"] >= flip and r["backend"] == f"v{v['fp16']}"), math.nan
    )
    last_old = max((r["sent"] for r in load.results if r["backend"] == f"v{v[GOOD]}"), default=flip)
    print(
        f"\nrollback: {len(load.results)} requests, {len(load.failed)} failed; registry written {event.took_s:.2f} s "
        f"after the request; first registry read after the flip done {fresh - flip:.2f} s after it; traffic on the "
        f"previous version {first_prev - flip:.2f} s after the flip; last request routed to the old version "
        f"{last_old - flip:.2f} s after it"
    )
    assert not load.failed, load.failed[:3]
    assert after, "no request was sent after the router re-read the registry"
    assert {r["backend"] for r in after} == {f"v{v['fp16']}"}
    assert aliases.current(client, MODEL)["production"] == v["fp16"]


def test_broken_build_is_aborted_by_shadow_agreement_without_client_errors(fleet, tmp_path):
    from registry import aliases, audit

    client, v = fleet["client"], fleet["v"]
    before = aliases.current(client, MODEL)
    outcome, load, lines = canary(fleet, "broken", fast_policy(), tmp_path)
    print(
        f"\nbroken build: {outcome.decision} at step {outcome.step} ({outcome.percent:g}%): {outcome.reason}; "
        f"{len(load.results)} requests, {len(load.failed)} failed"
    )
    assert outcome.decision == "aborted" and outcome.step < 4
    assert "shadow_agreement" in outcome.reason and "FAIL" in outcome.reason
    assert not load.failed, load.failed[:3]
    assert aliases.current(client, MODEL) == before  # production, previous, fallback untouched; no candidate
    cleared = [e for e in audit.history(client, MODEL) if e.action == "clear_candidate"][-1]
    assert cleared.canary_run_id == outcome.run_id and cleared.from_version == v["broken"]


def cutting_proxy(url: str, after: int):
    """A relay to the OpenAI server at `url` (…/v1) whose streams break after `after` text chunks,
    as a candidate server killed mid-answer does (the connection drops mid-response)."""
    from httpx_sse import aconnect_sse
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from gateway.payloads import chunk_text

    async def relay(request):
        body = await request.json()

        async def events():
            async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
                async with aconnect_sse(client, "POST", url + request.url.path.removeprefix("/v1"), json=body) as src:
                    sent = 0
                    async for ev in src.aiter_sse():
                        if sent >= after:
                            raise RuntimeError("cut by the test proxy")
                        yield f"data: {ev.data}\n\n".encode()
                        sent += ev.data != "[DONE]" and bool(chunk_text(json.loads(ev.data)))

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/v1/completions", relay, methods=["POST"]),
            Route("/v1/chat/completions", relay, methods=["POST"]),
        ]
    )


def streamed_text(base_url: str, path: str, body: dict) -> tuple[str, list]:
    """The text of a streamed answer and its SSE events."""
    from httpx_sse import connect_sse

    from gateway.payloads import chunk_text

    with (
        httpx.Client(timeout=300, trust_env=False) as client,
        connect_sse(client, "POST", base_url + path, json=body) as src,
    ):
        events = list(src.iter_sse())
    return "".join(
        chunk_text(json.loads(e.data)) for e in events if e.event == "message" and e.data != "[DONE]"
    ), events


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_stream_broken_mid_answer_is_finished_by_stable_word_for_word(fleet, chat):
    """Real vLLM on both sides: fp16 behind a proxy that cuts its streams after 3 chunks is the
    candidate, fp16 is stable; greedy, so the resumed answer must equal fp16's own."""
    from gateway.router import Backend, Router
    from gateway.server import AppServer, RouterServer

    fp16 = fleet["fleet"].backends[fleet["v"]["fp16"]]
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": True}
    body.update(
        {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
        if chat
        else {"prompt": "The three primary colours are"}
    )
    path = "/chat/completions" if chat else "/completions"
    direct, alone = streamed_text(fp16.url, path, {**body, "model": fp16.model})
    with AppServer(cutting_proxy(fp16.url, after=3), grace_s=1) as proxy:
        cut = Backend(f"{proxy.url}/v1", fp16.model, "cut-fp16")
        router = Router(lambda: {"stable": fp16, "candidate": cut, "shadow": None}, fast_router(), model_name=MODEL)
        router.set_weight(100)
        with RouterServer(router) as server:
            via, events = streamed_text(f"{server.url}/v1", path, body)
    print(f"\nresumed {path}: {via!r} (fp16 alone: {direct!r})")
    # more chunks than the proxy lets through, so the cut fell mid-answer (words vary with the kind: on a 2-core
    # AMX Xeon at bfloat16 fp16 answered "L'Étoile, la Marseillaise," in 12 tokens, 3 words)
    assert via == direct and len([e for e in alone if e.event == "message" and e.data != "[DONE]"]) > 3
    assert events[-1].data == "[DONE]" and not any(e.event == "error" for e in events)
    outcomes = sorted((s.role, s.outcome, s.retried) for s in router.samples_since(0))
    assert outcomes == [("candidate", "cut", False), ("stable", "ok", True)]


def test_killed_candidate_server_aborts_and_clients_see_no_error(fleet, tmp_path):
    from registry import aliases

    client = fleet["client"]
    outcome, load, lines = canary(fleet, GOOD, fast_policy(), tmp_path, kill_after_s=8)
    print(
        f"\nkilled candidate: {outcome.decision} at step {outcome.step}: {outcome.reason}; "
        f"{len(load.results)} requests, {len(load.failed)} failed"
    )
    assert outcome.decision == "aborted" and "error_rate" in outcome.reason
    assert not load.failed, load.failed[:3]
    assert "candidate" not in aliases.current(client, MODEL)


def test_memory_of_two_servers_and_router(fleet):
    """Report memory (not a timed target): RSS of the stable and candidate vLLM process groups."""
    total = 0
    for build in ("fp16", "broken"):
        pid = fleet["fleet"].pids[fleet["v"][build]]
        procs = [p for p in psutil.process_iter() if _pgid(p.pid) == pid]
        rss = sum(p.memory_info().rss for p in procs if p.is_running())
        total += rss
        print(f"\nmemory: {build} vLLM server: {rss / 2**30:.2f} GiB RSS in {len(procs)} processes")
    me = psutil.Process().memory_info().rss
    print(
        f"memory: two servers {total / 2**30:.2f} GiB + router/test process {me / 2**30:.2f} GiB; "
        f"machine {psutil.virtual_memory().total / 2**30:.0f} GiB"
    )
    assert 0 < total + me < psutil.virtual_memory().total


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None
