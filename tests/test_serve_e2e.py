"""`quantgate serve` end to end: the real CLI as a long-running process, real vLLM servers on
loopback, the registry of the shared `dvc repro` (tests/conftest.py `project`), bounded greedy
load throughout (tests/test_fleet_e2e.py `Load`).

In order, on one gateway: it serves the fp16 build; a candidate alias warms the int8 build
(W8A8, which every CPU kind serves); `quantgate promote` moves traffic to it from the gateway's next
registry read after the alias write; its vLLM server is killed and the fallback answers while it is restarted;
`quantgate rollback` moves traffic back the same way and the unplanned server is drained and
stopped; a broken build's canary on the running gateway aborts at step 1; a canary of the int8 build
(`canary run --gateway`: its admin endpoint) survives the gateway's SIGKILL at step 1 and promotes; SIGTERM
stops the gateway and every server. No client request fails, but while the gateway is down after its SIGKILL
(and at most 1 % just after it is back).
"""

import json
import math
import os
import signal
import subprocess
import time

import httpx
import psutil
import pytest

from tests.conftest import approved_version, project_env, run
from tests.test_fleet_e2e import MODEL, Load

pytestmark = pytest.mark.e2e
SERVED = "int8"  # W8A8: vLLM serves it on AVX2, AVX512 and GPUs alike
ADMIN_TOKEN = "e2e-admin-token-0123456789"


def wait_for(what: str, check, timeout_s: float, proc: subprocess.Popen, log) -> dict:
    """Poll `check()` every 0.5 s until it returns something truthy (a /health document);
    fail with the gateway's log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"quantgate serve exited ({proc.returncode}) waiting for {what}:\n{log.read_text()[-3000:]}")
        try:
            if got := check():
                return got
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"no {what} after {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def gateway(project, tmp_path_factory):
    """(url, registry client, {build: version}, the serve process, its log) with fp16 serving."""
    from quantgate.serving import free_port
    from registry import aliases, store

    client = store.client(f"sqlite:///{project / 'mlflow.db'}")
    reg = json.loads((project / "results/registry.json").read_text())
    n_docs = json.loads((project / "results/teams.json").read_text())["search"]["n_docs"]
    entry = reg["builds"].get(SERVED) or reg["unregistered"][SERVED]
    v = {"fp16": str(reg["builds"]["fp16"]["version"]), SERVED: approved_version(client, MODEL, SERVED, entry, n_docs)}
    now = aliases.current(client, MODEL)
    if now.get("production") not in (None, v["fp16"]):  # an earlier test left another build in production
        aliases.rollback(client, MODEL, "e2e-test", "serve e2e starts from the fp16 build", to="fallback")
    port, admin_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"

    def start() -> subprocess.Popen:  # the same gateway again (ports, work dir); its log appended
        with open(log, "a") as out:
            return subprocess.Popen(
                ["quantgate", "serve", MODEL, "--port", str(port), "--admin-port", str(admin_port)]
                + ["--work-dir", str(log.parent / "work")],
                cwd=project,
                env={**project_env(), "QUANTGATE_ADMIN_TOKEN": ADMIN_TOKEN},
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    g = {"url": url, "admin": f"http://127.0.0.1:{admin_port}", "client": client, "v": v, "log": log, "start": start}
    g["proc"] = start()
    try:
        wait_for("healthy gateway", lambda: _health(url) or None, 600, g["proc"], log)
        print(f"\nserve: gateway healthy {time.monotonic() - started:.0f} s after start")
        yield g
    finally:
        proc = g["proc"]  # the last one started
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
        from gateway.serve import reap_orphans

        reap_orphans(log.parent / "work")  # a gateway that had to be killed leaves its servers


def _health(url: str) -> dict:
    r = httpx.get(f"{url}/health", timeout=5)
    return r.json() if r.status_code == 200 else {}


def _next_resolve(url: str, client, action: str) -> tuple[float, float]:
    """(the alias write of the last `action` on production, the end of the gateway's first registry read that
    began after it), both wall-clock s: polls /health's `resolved` every 0.1 s (for at most 30 s)."""
    from registry import audit

    event = [e for e in audit.history(client, MODEL) if e.action == action and e.alias == "production"][-1]
    flip = event.done_at.timestamp()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        resolved = _health(url).get("resolved")
        if resolved and resolved[0] >= flip:
            return flip, resolved[1]
        time.sleep(0.1)
    pytest.fail(f"the gateway did not read the registry within 30 s of the {action}")


def _switch(load: Load, flip: float, fresh: float, new: str, old: str) -> tuple[float, float, set[str]]:
    """(s from the alias write to the first request served by `new`, s to the last one sent to `old`, the backends
    of the requests sent after the gateway's first registry read after the write (`fresh`))."""
    first_new = (
        next((r["sent"] for r in load.results if r["sent"] >= flip and r["backend"] == f"v{new}"), math.nan) - flip
    )
    last_old = max((r["sent"] for r in load.results if r["backend"] == f"v{old}"), default=flip) - flip
    return first_new, last_old, {r["backend"] for r in load.results if r["sent"] >= fresh}


def test_serves_fallback_then_warms_a_candidate(gateway):
    from registry import aliases

    g, v = gateway, gateway["v"]
    h = _health(g["url"])
    assert h["stable"] == f"v{v['fp16']}" and v["fp16"] in h["fleet"]
    r = httpx.post(
        f"{g['url']}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 4},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert r.headers["x-canary-backend"] == f"v{v['fp16']}"
    aliases.set_candidate(g["client"], MODEL, v[SERVED], "e2e-test", "serve e2e: warm the build before promoting it")
    h = wait_for(
        "warm candidate", lambda: (h := _health(g["url"])) and v[SERVED] in h["fleet"] and h, 600, g["proc"], g["log"]
    )
    assert h["fleet"][v[SERVED]]["why"] == "candidate"


def test_memory_of_the_standing_fleet(gateway):
    """Report memory (not a timed target) with the fp16 build serving and the candidate warm: RSS of each
    warm server's process group and of the gateway."""
    assert len(_health(gateway["url"])["fleet"]) == 2
    h = _health(gateway["url"])
    total = 0
    for version, s in h["fleet"].items():
        rss = sum(p.memory_info().rss for p in psutil.process_iter() if _pgid(p.pid) == s["pid"])
        total += rss
        print(f"\nmemory: v{version} ({s['why']}) vLLM server {rss / 2**30:.2f} GiB RSS")
    me = psutil.Process(gateway["proc"].pid).memory_info().rss
    print(
        f"memory: servers {total / 2**30:.2f} GiB + gateway {me / 2**30:.2f} GiB; "
        f"machine {psutil.virtual_memory().total / 2**30:.0f} GiB"
    )
    assert 0 < total + me < psutil.virtual_memory().total


def test_promote_moves_traffic_at_the_next_registry_read_without_errors(gateway, project):
    from registry import aliases

    g, v = gateway, gateway["v"]
    production = aliases.current(g["client"], MODEL).get("production", "none")  # fp16 or none (the fixture)
    with Load(g["url"]) as load:
        time.sleep(5)
        run(
            [
                "quantgate",
                "promote",
                MODEL,
                v[SERVED],
                "--expect-production",
                production,
                "--by",
                "e2e-test",
                "--reason",
                "serve e2e: promote",
            ],
            project,
        )
        flip, fresh = _next_resolve(g["url"], g["client"], "promote")
        time.sleep(5)
    first_new, last_old, after = _switch(load, flip, fresh, v[SERVED], v["fp16"])
    print(
        f"\npromote: {len(load.results)} requests, {len(load.failed)} failed; registry read {fresh - flip:.2f} s "
        f"after the alias write; first on v{v[SERVED]} {first_new:.2f} s after it, "
        f"last on v{v['fp16']} {last_old:.2f} s"
    )
    assert not load.failed, load.failed[:3]
    # every request sent once the gateway had read the registry after the write went to the new build; how many
    # seconds that took (resolve interval + one registry read) is printed, not asserted: a loaded CI machine varies
    assert after == {f"v{v[SERVED]}"}


def test_killed_production_server_is_answered_by_fallback_and_restarted(gateway):
    g, v = gateway, gateway["v"]
    pid = _health(g["url"])["fleet"][v[SERVED]]["pid"]
    with Load(g["url"]) as load:
        time.sleep(3)
        os.killpg(pid, signal.SIGKILL)
        killed = time.time()
        h = wait_for(
            "restarted production server",
            lambda: (
                (h := _health(g["url"]))
                and h["fleet"].get(v[SERVED], {}).get("restarts") == 1
                and h["stable"] == f"v{v[SERVED]}"  # the router routes to it again
                and h
            ),
            600,
            g["proc"],
            g["log"],
        )
        restarted = time.time()
        time.sleep(5)
    during = [r for r in load.results if killed <= r["sent"] < restarted]
    by = {b: sum(r["backend"] == b for r in during) for b in {r["backend"] for r in during}}
    print(
        f"\nkill: {len(load.results)} requests, {len(load.failed)} failed; "
        f"restarted in {restarted - killed:.0f} s; served meanwhile by {by}"
    )
    assert not load.failed, load.failed[:3]
    assert h["fleet"][v[SERVED]]["pid"] != pid and h["stable"] == f"v{v[SERVED]}"
    assert by.get(f"v{v['fp16']}", 0) > 0  # the fallback answered while production was down


def test_rollback_moves_traffic_back_and_drains_the_old_server(gateway, project):
    g, v = gateway, gateway["v"]
    old_pid = _health(g["url"])["fleet"][v[SERVED]]["pid"]
    with Load(g["url"]) as load:
        time.sleep(5)
        run(["quantgate", "rollback", MODEL, "--by", "e2e-test", "--reason", "serve e2e: rollback"], project)
        flip, fresh = _next_resolve(g["url"], g["client"], "rollback")
        time.sleep(5)
    first_new, last_old, after = _switch(load, flip, fresh, v["fp16"], v[SERVED])
    print(
        f"\nrollback: {len(load.results)} requests, {len(load.failed)} failed; registry read {fresh - flip:.2f} s "
        f"after the alias write; first on v{v['fp16']} {first_new:.2f} s after it, "
        f"last on v{v[SERVED]} {last_old:.2f} s"
    )
    assert not load.failed, load.failed[:3]
    assert after == {f"v{v['fp16']}"}  # see the promote test
    h = wait_for(
        "drained server",
        lambda: (h := _health(g["url"])) and v[SERVED] not in h["fleet"] and h,
        120,
        g["proc"],
        g["log"],
    )
    assert (
        set(h["fleet"]) == {v["fp16"]}
        and not psutil.pid_exists(old_pid)
        or psutil.Process(old_pid).status() == psutil.STATUS_ZOMBIE
    )


def test_a_broken_build_on_the_running_gateway_aborts_at_step_1(gateway, project):
    """Issue 16 (c): `canary run --gateway` of an approved but broken build (embedding rows permuted:
    it loads and answers garbage) on the running gateway aborts at step 1 on shadow agreement,
    sets the gateway's weight back to 0, leaves production as it was, and clients see no error
    (a garbage answer is an answer; the check is what catches it)."""
    from canary.controller import Admin, Hooks, run_canary_on_gateway
    from gateway.admin import RemoteRouter
    from registry import aliases
    from tests.policies import fast_policy
    from tests.test_fleet_e2e import register_broken

    g, v = gateway, gateway["v"]
    assert aliases.current(g["client"], MODEL).get("production") == v["fp16"]
    broken = register_broken(project, g["client"])  # the fleet e2e's, when it ran first
    aliases.set_candidate(g["client"], MODEL, broken, "e2e-test", "serve e2e: warm the broken build")
    wait_for(
        "warm broken build", lambda: (h := _health(g["url"])) and broken in h["fleet"] and h, 600, g["proc"], g["log"]
    )
    # step 1 at 50 %: the abort needs about 11 shadow comparisons, 5x sooner than at the default 10 %
    # (CI time; the default plan's abort is simulated in benchmarks/canary_sim.py)
    policy = fast_policy(ttft_p95_ratio=50, tpot_p95_ratio=50, warm_timeout_s=600, steps=[50, 100])
    lines: list[str] = []
    with Load(g["url"]) as load:
        outcome = run_canary_on_gateway(
            g["client"], MODEL, broken, policy, "e2e-test", Admin(g["admin"], ADMIN_TOKEN), Hooks(lines.append)
        )
    print(f"\nbroken build on the gateway: {outcome.decision} at step {outcome.step}: {outcome.reason}")
    assert outcome.decision == "aborted" and outcome.step == 1, "\n".join(lines[-30:])
    assert "shadow_agreement" in outcome.reason and "FAIL" in outcome.reason, outcome.reason
    assert RemoteRouter(g["admin"], ADMIN_TOKEN).state()["weight"] == 0
    now = aliases.current(g["client"], MODEL)
    assert now.get("production") == v["fp16"] and now.get("candidate") is None
    assert g["client"].get_run(outcome.run_id).data.tags["canary.phase"] == "aborted"
    assert not load.failed, load.failed[:3]
    wait_for(
        "broken build drained", lambda: (h := _health(g["url"])) and broken not in h["fleet"] and h, 120,
        g["proc"], g["log"],
    )  # fmt: skip


def test_a_gateway_killed_mid_canary_comes_back_serving_production_and_the_canary_resumes(gateway, project):
    """Issue 16 (c) and (d): after the rollback (fp16 production, int8 drained), `canary run --gateway` of the
    approved int8 build warms it through the `candidate` alias and walks the steps through the admin endpoint
    under load. At step 1 `quantgate serve` is SIGKILLed and started again (same ports and work dir): the new
    gateway reaps the old one's vLLM servers, serves production (fp16) again and warms the candidate; the
    controller waits for it (gateway_lost_s), sets the step's weight again, records `canary.resumed`, and the
    canary promotes. No request that ended before the kill failed. Fast policy (tests/policies.py), latency
    thresholds relaxed: this judges errors and agreement with fp16 on a CPU, not speed. One canary does both
    (c) and (d): a second walk of its own cost CI 120 s, and the fleet's walk of every step is
    tests/test_fleet_e2e.py's."""
    import threading

    from canary.controller import Admin, Hooks, run_canary_on_gateway
    from registry import aliases
    from tests.policies import fast_policy

    g, v = gateway, gateway["v"]
    if aliases.current(g["client"], MODEL).get("production") != v["fp16"]:  # a test before failed mid-way
        run(["quantgate", "rollback", MODEL, "--by", "e2e-test", "--reason", "serve e2e: before the crash"], project)
    assert aliases.current(g["client"], MODEL).get("production") == v["fp16"]
    # warm the candidate before the load starts: a vLLM CPU server starting beside another one that is
    # busy answering was seen starved for minutes here (its engine process pinned to the busy core);
    # canary run then finds `candidate` already set and warm
    aliases.set_candidate(g["client"], MODEL, v[SERVED], "e2e-test", "serve e2e: warm the canary's build")
    wait_for(
        "warm candidate", lambda: (h := _health(g["url"])) and v[SERVED] in h["fleet"] and h, 600, g["proc"], g["log"]
    )
    # two steps: a step's weight, the crash and the resume are what is tested here, every step is the fleet's
    policy = fast_policy(ttft_p95_ratio=50, tpot_p95_ratio=50, gateway_lost_s=900, min_step_s=20, steps=[50, 100])
    lines: list[str] = []
    result: dict = {}

    def controller():
        result["outcome"] = run_canary_on_gateway(
            g["client"], MODEL, v[SERVED], policy, "e2e-test", Admin(g["admin"], ADMIN_TOKEN), Hooks(lines.append)
        )

    # 0.5 req/s, not 1.5: after the restart the candidate's vLLM server starts beside fp16 answering all the
    # load, and this machine's kernel starved its engine process (pinned to the busy core) for over 600 s
    # when the fp16 worker was ~100 % busy (seen once in four runs; moving it to both cores freed it at once)
    with Load(g["url"], rps=0.5) as load:
        t = threading.Thread(target=controller, daemon=True)
        t.start()
        wait_for("step 1", lambda: any("canary: step 1/" in line for line in lines), 300, g["proc"], g["log"])
        # the kill comes after an answer through the gateway at step 1, so "no request failed before it" is a check
        wait_for("an answer at step 1", lambda: [r for r in load.results if r["ok"]], 120, g["proc"], g["log"])
        time.sleep(3)
        old = g["proc"]
        servers = [int(f.read_text()) for f in (g["log"].parent / "work").glob("v*/server.pid")]
        assert servers, "the gateway recorded no vLLM server"
        old.kill()  # SIGKILL: no cleanup of its own
        killed = time.time()
        old.wait(timeout=30)
        g["proc"] = g["start"]()
        wait_for(
            "gateway back, serving production",
            lambda: (h := _health(g["url"])) and h.get("stable") == f"v{v['fp16']}" and h,
            900, g["proc"], g["log"],
        )  # fmt: skip
        back = time.time()
        t.join(timeout=1200)
    outcome = result.get("outcome")
    after = [r for r in load.results if r["sent"] >= back + 1]
    print(
        f"\ncrash: gateway back serving v{v['fp16']} {back - killed:.0f} s after SIGKILL; canary "
        f"{outcome and outcome.decision}; {len(load.failed)} of {len(load.results)} requests failed "
        f"(all while it was down: {sum(not r['ok'] for r in after)} after)"
    )
    assert outcome is not None, "\n".join(lines[-20:])
    tags = g["client"].get_run(outcome.run_id).data.tags
    # "the gateway stopped answering" or "the gateway restarted", whichever the controller saw first
    assert tags["canary.resumed"].startswith("step 1: the gateway "), tags.get("canary.resumed")
    assert outcome.decision == "promoted" and tags["canary.phase"] == "promoted", "\n".join(lines[-20:])
    assert tags["canary.step"] == str(len(policy.steps))
    assert aliases.current(g["client"], MODEL).get("production") == v[SERVED]
    assert any("resumed at" in line for line in lines)
    before = [r for r in load.results if r["done"] < killed]
    assert before and all(r["ok"] for r in before), json.dumps([r for r in before if not r["ok"]][:3], indent=1)
    # Once it is back, the gateway answers. (d) asks that production be served again, not that no request
    # ever fails after: CI once saw 1 of ~250 fail on v1 there (2 cores, two vLLM servers, the test, the
    # registry), so a stray failure is allowed, shown with the gateway's log, and more than 1 % (or 1) is not.
    bad = [r for r in after if not r["ok"]]
    if bad:
        print(json.dumps(bad[:5], indent=1) + "\n" + "\n".join(g["log"].read_text().splitlines()[-60:]))
    assert len(after) >= 30 and len(bad) <= max(1, len(after) // 100), json.dumps(bad[:5], indent=1)
    # the killed gateway's vLLM servers are gone: their orphan guard (quantgate.serving.orphan_guard) killed
    # them when it died, or the new gateway reaped them ("an earlier gateway left running")
    assert not [pid for pid in servers if running(pid)]
    # promote writes production, then clears candidate (two alias writes): a registry read between them
    # shows the promoted build as both for one resolve interval (CI saw it once), so wait for both
    wait_for(
        "promoted build serving, no candidate",
        lambda: (h := _health(g["url"])) and h["stable"] == f"v{v[SERVED]}" and h["candidate"] is None and h,
        60, g["proc"], g["log"],
    )  # fmt: skip


def running(pid: int) -> bool:
    """True while process `pid` runs (a zombie has ended)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_sigterm_stops_the_gateway_and_every_server(gateway):
    pids = [s["pid"] for s in _health(gateway["url"])["fleet"].values()]
    gateway["proc"].send_signal(signal.SIGTERM)
    assert gateway["proc"].wait(timeout=120) == 0
    assert "serve: every server stopped" in gateway["log"].read_text()
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None
