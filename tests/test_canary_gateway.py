"""The gateway's admin endpoint and a canary driven through it (gateway/admin.py, canary/status.py,
controller.run_canary_on_gateway), with fake OpenAI backends and a sqlite registry: no vLLM
(the real one: tests/test_serve_e2e.py)."""

import json
import os
import stat
import threading
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from canary import status as canary_status
from canary.analysis import analyze
from canary.controller import Aborted, Admin, GatewaySplit, Hooks, Local, Spec, _run_steps, run_canary_on_gateway
from canary.plan import StepPlan, Traffic
from canary.policy import CanaryPolicy
from canary.status import EXPERIMENT, Phase, Status, reap_stale
from cli.main import cli
from gateway.admin import GatewayUnreachable, RemoteRouter, admin_app, admin_token, read_token
from gateway.metrics import Sample, ShadowSample
from gateway.router import Backend, Router, RouterParams, Schedule
from gateway.server import AppServer, RouterServer
from quantgate.errors import QuantgateError
from quantgate.serving import free_port
from registry import aliases, store
from tests.test_canary_render import MODEL, project, sqlite_registry  # noqa: F401 (fixtures)
from tests.test_canary_router import Fake

TOKEN = "s3cret-token"
QUIET = Hooks(lambda line: None)  # a canary run that says nothing
STABLE = Backend("http://127.0.0.1:9/v1", "m-v1", "v1")
CANDIDATE = Backend("http://127.0.0.1:9/v1", "m-v2", "v2")


def sample(t: float, role: str = "candidate", ok: bool = True) -> Sample:
    return Sample(t, role, "v2", ok, 200 if ok else 500, 0.1, 0.01, False, 0.5, True, "ok" if ok else "server_error")


class Gateway:
    """A Router (resolve() given) with its admin app on AppServers, restartable on the same admin port."""

    def __init__(self, resolve, fleet=lambda: {"2": {"alive": True}}, params: RouterParams | None = None, model=None):
        self.resolve, self.fleet, self.params, self.model = resolve, fleet, params or RouterParams(), model
        self.admin_port, self.public_port = free_port(), free_port()
        self.router = self.public = self.admin = None

    def start(self) -> "Gateway":
        self.router = Router(self.resolve, self.params, schedule=Schedule(0.1))
        self.public = RouterServer(self.router, "127.0.0.1", self.public_port, grace_s=1).start()
        started = time.time()

        def state():
            s = {"url": self.public.url, "pid": os.getpid(), "started_at": started, "fleet": self.fleet()}
            return {**s, "model": self.model} if self.model else s

        self.admin = AppServer(admin_app(self.router, state, TOKEN), "127.0.0.1", self.admin_port, grace_s=1).start()
        return self

    def stop(self) -> None:
        for s in (self.admin, self.public):
            if s is not None:
                s.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"


@pytest.fixture
def gateway():
    g = Gateway(lambda: {"stable": STABLE, "candidate": CANDIDATE}).start()
    yield g
    g.stop()


def test_admin_needs_the_token(gateway):
    for headers, why in (({}, "no Authorization header"), ({"Authorization": "Bearer nope"}, "a wrong token")):
        r = httpx.get(f"{gateway.url}/admin/state", headers=headers)
        assert r.status_code == 401 and why in r.json()["error"]["message"]
        assert "QUANTGATE_ADMIN_TOKEN" in r.json()["error"]["message"]
    r = httpx.put(f"{gateway.url}/admin/weight", json={"percent": 50}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and gateway.router.weight == 0
    r = httpx.get(f"{gateway.url}/admin/state", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200
    s = r.json()
    assert (s["weight"], s["stable"], s["candidate"], s["shadow"]) == (0, "v1", "v2", None)
    assert s["fleet"] == {"2": {"alive": True}} and s["url"] == gateway.public.url


def test_weight_is_set_and_validated(gateway):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for bad in ({"percent": 101}, {"percent": -1}, {"percent": "10"}, {"percent": True}, {}, [10]):
        r = httpx.put(f"{gateway.url}/admin/weight", json=bad, headers=auth)
        assert r.status_code == 400 and "0 to 100" in r.json()["error"]["message"], bad
    r = httpx.put(f"{gateway.url}/admin/weight", content=b"not json", headers=auth)
    assert r.status_code == 400
    r = httpx.put(f"{gateway.url}/admin/weight", json={"percent": 25}, headers=auth)
    assert r.status_code == 200 and gateway.router.weight == 25


def test_remote_router_round_trips_samples_into_the_analysis(gateway):
    now = time.time()
    rec = gateway.router.recorder
    local = [sample(now - 10, "stable"), sample(now, "candidate"), sample(now + 0.001, "candidate", ok=False)]
    local += [sample(now + 0.002, "stable")]
    for s in local:
        rec.add(s)
    shadows = [ShadowSample(now, True, "v2", "v1"), ShadowSample(now + 1, False, "v2", "v1")]
    for s in shadows:
        rec.add_shadow(s)
    remote = RemoteRouter(gateway.url, TOKEN)
    try:
        assert remote.samples_since(now) == local[1:] and remote.samples_since(0) == local
        assert remote.shadows_since(now) == shadows and remote.shadows_since(now + 0.5) == shadows[1:]
        policy = CanaryPolicy(min_samples=2)
        assert analyze(remote.samples_since(0), remote.shadows_since(0), policy) == analyze(local, shadows, policy)
        remote.set_weight(40)
        assert gateway.router.weight == 40 and remote.state()["weight"] == 40
        assert remote.alive("2") and not remote.alive("3") and remote.warm("2") and not remote.warm("1")
    finally:
        remote.close()
    bad = RemoteRouter(gateway.url, "wrong")
    with pytest.raises(QuantgateError, match="HTTP 401: admin endpoint: a wrong token"):
        bad.state()
    bad.close()


def test_token_from_env_or_a_0600_file(tmp_path, monkeypatch):
    monkeypatch.delenv("QUANTGATE_ADMIN_TOKEN", raising=False)
    token = admin_token(tmp_path, log=lambda line: None)
    f = tmp_path / "admin.token"
    assert f.read_text().strip() == token and len(token) > 30
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and read_token(f) == token
    assert admin_token(tmp_path, log=lambda line: None) != token  # a new one each start
    monkeypatch.setenv("QUANTGATE_ADMIN_TOKEN", " from-env-0123456789 ")
    assert admin_token(tmp_path, log=lambda line: None) == "from-env-0123456789"
    assert read_token(tmp_path / "none") == "from-env-0123456789"
    for weak, why in (("a", "1 characters"), ("   ", "blank")):  # once accepted, and silently ignored
        monkeypatch.setenv("QUANTGATE_ADMIN_TOKEN", weak)
        with pytest.raises(QuantgateError, match=rf"^\$QUANTGATE_ADMIN_TOKEN is {why}; give at least 16"):
            admin_token(tmp_path, log=lambda line: None)
    monkeypatch.delenv("QUANTGATE_ADMIN_TOKEN")
    with pytest.raises(QuantgateError, match="no admin token"):
        read_token(tmp_path / "none")


def test_a_token_file_that_cannot_be_read_is_named_as_the_option(tmp_path, monkeypatch):
    """A missing --token-file or a folder said '... and /x/none cannot be read (...); give --token-file', to a user
    who gave it; its siblings (a FIFO, a broken link) name the option and the file to give."""
    monkeypatch.delenv("QUANTGATE_ADMIN_TOKEN", raising=False)
    for path, why in ((tmp_path / "none", "No such file or directory"), (tmp_path, "Is a directory")):
        with pytest.raises(QuantgateError) as exc:
            read_token(path)
        assert str(exc.value) == (
            f"no admin token: $QUANTGATE_ADMIN_TOKEN is unset and --token-file {path} cannot be read ({why}); give "
            "the file the gateway wrote (WORK_DIR/admin.token)"
        )


def test_a_token_no_header_can_carry_is_refused_naming_where_it_came_from(tmp_path, monkeypatch):
    """$QUANTGATE_ADMIN_TOKEN='ü' reached httpx, which failed with a UnicodeEncodeError traceback; a blank one was
    said to be unset."""
    for bad, said in (("ü", "a non-ASCII character ('ü')"), ("ab\x01cd", "a control character ('\\x01')")):
        monkeypatch.setenv("QUANTGATE_ADMIN_TOKEN", bad)
        with pytest.raises(QuantgateError) as exc:
            read_token(tmp_path / "none")
        assert str(exc.value).startswith(f"$QUANTGATE_ADMIN_TOKEN has {said}"), exc.value
        assert "set it to the gateway's admin token, or unset it to read --token-file" in str(exc.value)
        with pytest.raises(QuantgateError, match=r"^\$QUANTGATE_ADMIN_TOKEN has a .*; give printable ASCII, e\.g\."):
            admin_token(tmp_path, log=lambda line: None)  # the gateway would start with a token no client can send
    monkeypatch.setenv("QUANTGATE_ADMIN_TOKEN", "  ")
    with pytest.raises(QuantgateError, match=r"^no admin token: \$QUANTGATE_ADMIN_TOKEN is blank and "):
        read_token(tmp_path / "none")
    (tmp_path / "ok.token").write_text("from-file-0123456789\n")
    assert read_token(tmp_path / "ok.token") == "from-file-0123456789"  # blank: the file, as when unset
    monkeypatch.delenv("QUANTGATE_ADMIN_TOKEN")
    (tmp_path / "bad.token").write_text("tök\n")
    with pytest.raises(QuantgateError) as exc:
        read_token(tmp_path / "bad.token")
    assert str(exc.value) == (
        f"--token-file {tmp_path / 'bad.token'}: the token has a non-ASCII character ('ö'), which an HTTP header "
        "cannot carry; give the file the gateway wrote (WORK_DIR/admin.token)"
    )
    (tmp_path / "binary.token").write_bytes(b"\xff\xfe\n")
    with pytest.raises(QuantgateError, match="is not UTF-8 text; give the file the gateway wrote"):
        read_token(tmp_path / "binary.token")


def test_a_restarted_gateway_is_waited_for_and_the_weight_set_again(gateway):
    split = GatewaySplit(gateway.url, TOKEN, "2", lost_s=10)
    try:
        split.set_weight(25)
        split.attach(split.state())
        assert split.recover(25) is None  # nothing happened
        gateway.stop()  # the gateway dies ...
        restart = threading.Timer(1.0, gateway.start)  # ... and comes back at 0 % a second later
        restart.start()
        why = split.recover(25)
        restart.join()
        assert "stopped answering" in why and gateway.router.weight == 25
        gateway.router.set_weight(0)  # a restart between two looks: the admin endpoint answers at 0 %
        assert "weight was 0%, not 25%" in split.recover(25) and gateway.router.weight == 25
    finally:
        split.close()


def test_a_gateway_that_does_not_come_back_in_time_aborts(gateway):
    split = GatewaySplit(gateway.url, TOKEN, "2", lost_s=1)
    split.attach(split.state())
    gateway.stop()
    t0 = time.monotonic()
    with pytest.raises(GatewayUnreachable, match="not back within gateway_lost_s=1 s"):
        split.recover(10)
    assert time.monotonic() - t0 < 5
    split.close()


class FakeSplit:
    shadow_teams = 1

    def __init__(self, recovers):
        self.recovers, self.weights = list(recovers), []

    def set_weight(self, p):
        self.weights.append(p)

    def samples_since(self, t):
        return []

    def shadows_since(self, t):
        return []

    def alive(self, version):
        return True

    def engine(self, version):
        return None

    def recover(self, percent):
        r = self.recovers.pop(0)
        if isinstance(r, Exception):
            raise r
        return r


class FakeStatus:
    def __init__(self):
        self.sets, self.beats = [], 0

    def set(self, phase=None, **fields):
        self.sets.append((phase, fields))

    def beat(self):
        self.beats += 1


def test_the_step_loop_resumes_once_then_aborts_when_the_gateway_is_lost():
    policy = CanaryPolicy(steps=[10, 100], check_interval_s=0.01, min_step_s=0.01, max_step_s=60)
    split = FakeSplit([None, "the gateway restarted (weight 0%, not 10%)", None, GatewayUnreachable("gone")])
    status = FakeStatus()
    plan = (StepPlan(1, 10, 1.0, "x"), StepPlan(2, 100, 1.0, "x"))
    with pytest.raises(Aborted) as exc:
        spec = Spec(None, MODEL, "2", "1", None, "1", policy, "tester")
        _run_steps(split, spec, plan, Hooks(lambda line: None), lambda i, m, e: None, status)
    assert exc.value.args == ("gone", 1, 10)
    assert (Phase.PROGRESSING, {"step": 1, "weight": 10}) in status.sets
    assert (None, {"resumed": "step 1: the gateway restarted (weight 0%, not 10%)"}) in status.sets
    assert status.beats == 2 and split.weights == [10]


# --- a whole canary on a fake gateway, with the registry of tests/test_canary_render.py ---


@pytest.fixture
def fake_fleet(project):  # noqa: F811
    """{version: Fake backend}: v1 (fp16, fallback), v2 answers as v1 does, v3 answers HTTP 500."""
    fakes = {v: Fake(f"v{v}", "the same answer every time") for v in ("1", "2", "3")}
    for f in fakes.values():
        f.server.start()
    fakes["3"].reset(status=500)
    yield fakes
    for f in fakes.values():
        f.server.stop()


def registry_gateway(client, fakes) -> Gateway:
    def backend(v):
        return Backend(f"{fakes[v].server.url}/v1", f"m-v{v}", f"v{v}") if v else None

    def resolve():
        now = aliases.current(client, MODEL)
        return {
            "stable": backend(now.get("production") or now["fallback"]),
            "candidate": backend(now.get("candidate")),
            "shadow": backend(now["fallback"]),
        }

    def fleet():
        return {v: {"alive": True, "url": f"{fakes[v].server.url}/v1"} for v in aliases.current(client, MODEL).values()}

    return Gateway(resolve, fleet, RouterParams(shadow_fraction=1.0, shadow_compare_words=2)).start()


FAST = CanaryPolicy(
    steps=[50, 100],
    min_step_s=0.5,
    max_step_s=30,
    check_interval_s=0.3,
    min_samples=3,
    warm_timeout_s=20,
    gateway_lost_s=5,
    stale_after_s=60,
).with_bounds(
    shadow_agreement=0.5,
    ttft_p95_ratio=50,  # fake backends on a busy machine: judge errors and agreement, not speed
    tpot_p95_ratio=50,
)


def load(url: str, stop: threading.Event) -> threading.Thread:
    def send():
        with httpx.Client(timeout=10) as c:
            i = 0
            while not stop.is_set():
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
                try:
                    c.post(f"{url}/v1/chat/completions", json={**body, "stream": bool(i % 2), "max_tokens": 4})
                except httpx.HTTPError:
                    pass  # the gateway is restarting
                i += 1
                time.sleep(0.02)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    return t


@pytest.fixture
def on_gateway(project, fake_fleet):  # noqa: F811
    """run(version, during=None) -> (outcome, log lines, gateway): a canary on a fake gateway under
    load; `during(gateway)` runs in a thread once the candidate is warm."""
    client = project
    g = registry_gateway(client, fake_fleet)

    def run(version: str, during=None):
        stop, lines = threading.Event(), []

        def on_router(url):
            t = load(url, stop)
            if during:
                threading.Thread(target=during, args=(g,), daemon=True).start()
            return lambda: (stop.set(), t.join())

        traffic = Traffic(20, 0.5, 1.0, "test", shadow_fraction=1.0)  # the gateway's
        hooks = Hooks(lines.append, on_router=on_router, traffic=traffic)
        outcome = run_canary_on_gateway(client, MODEL, version, FAST, "tester", Admin(g.url, TOKEN), hooks)
        return outcome, lines, client.get_run(outcome.run_id).data.tags

    yield run
    g.stop()


def test_an_approved_build_promotes_on_the_gateway(on_gateway, project, tmp_path):  # noqa: F811
    outcome, lines, tags = on_gateway("2")
    assert outcome.decision == "promoted", outcome.reason
    now = aliases.current(project, MODEL)
    assert now.get("production") == "2" and "candidate" not in now
    assert tags["canary.phase"] == "promoted" and tags["canary.step"] == "2" and tags["canary.failed_checks"] == ""
    assert tags["canary.controller"].endswith(f":{os.getpid()}") and float(tags["canary.heartbeat"]) > time.time() - 60
    assert "canary.resumed" not in tags
    # each step's evidence: the check lines it was judged on and every attempt behind them
    for step in ("1", "2"):
        path = project.download_artifacts(outcome.run_id, f"canary/step-{step}.json", tmp_path)
        evidence = json.loads(Path(path).read_text())
        assert evidence["verdict"] == "PASS" and any(c.startswith("error_rate 0.000") for c in evidence["checks"])
        assert {s["role"] for s in evidence["samples"]} >= {"candidate"} and evidence["shadows"]
        assert all(s["agree"] for s in evidence["shadows"])  # v2 answers as v1 does


def test_a_candidate_profiled_too_slow_is_forecast_at_the_start_and_still_judged_live(on_gateway, project):  # noqa: F811
    """The versions' profile tags (register stage) say v2 decodes 60x slower than v1, above FAST's
    tpot_p95_ratio max 50: the canary says so before step 1 and records it, but the live checks decide
    (the fake backends are equally fast), so it promotes."""
    figures = {"1": "10", "2": "600"}
    for v, tpot in figures.items():
        for key, value in {"buys.status": "profiled", "buys.concurrency": "8", "buys.tpot_ms_p50": tpot}.items():
            project.set_model_version_tag(MODEL, v, key, value)
    try:
        outcome, lines, tags = on_gateway("2")
    finally:
        for v in figures:
            for key in ("buys.status", "buys.concurrency", "buys.tpot_ms_p50"):
                project.delete_model_version_tag(MODEL, v, key)
    forecast = [line for line in lines if line.startswith("canary: forecast: ")]
    assert len(forecast) == 1 and "60.00x, above tpot_p95_ratio max 50" in forecast[0], lines
    assert lines.index(forecast[0]) < next(i for i, line in enumerate(lines) if "step 1/" in line)
    assert tags["canary.forecast"] == forecast[0].removeprefix("canary: forecast: ")
    assert outcome.decision == "promoted", outcome.reason


def test_a_broken_build_aborts_at_step_1_with_the_weight_back_to_0(on_gateway, project):  # noqa: F811
    outcome, lines, tags = on_gateway("3")
    assert (outcome.decision, outcome.step) == ("aborted", 1), lines
    assert "error_rate" in outcome.reason and "candidate" not in aliases.current(project, MODEL)
    assert "production" not in aliases.current(project, MODEL)
    assert (tags["canary.phase"], tags["canary.step"], tags["canary.weight"]) == ("aborted", "1", "0")
    assert "error_rate" in tags["canary.failed_checks"]


def test_a_gateway_restarted_mid_canary_resumes_the_step_and_promotes(on_gateway, project):  # noqa: F811
    def restart(g):
        time.sleep(0.4)
        g.stop()  # a killed `quantgate serve` comes back at 0 % to the candidate
        time.sleep(1.0)
        g.start()

    outcome, lines, tags = on_gateway("2", during=restart)
    assert outcome.decision == "promoted", outcome.reason
    assert tags["canary.resumed"].startswith("step 1: the gateway"), tags.get("canary.resumed")
    assert any("resumed at 50%" in line for line in lines)


def test_a_canary_whose_controller_died_is_recorded_as_aborted(project):  # noqa: F811
    client = project
    exp = store.experiment_id(client, EXPERIMENT, client.tracking_uri)
    runs = {}
    for name, beat_age, phase in (
        ("dead", 600, Phase.PROGRESSING),
        ("alive", 1, Phase.PROGRESSING),
        ("promoting", 600, Phase.PROMOTING),
    ):
        run_id = client.create_run(exp, tags={"model": MODEL, "candidate_version": "2"}).info.run_id
        Status(client, run_id).set(phase, step=1, weight=10.0)
        client.set_tag(run_id, "canary.heartbeat", f"{time.time() - beat_age:.1f}")
        client.set_tag(run_id, "canary.controller", "deadhost:4242")
        runs[name] = run_id
    aliases.set_candidate(client, MODEL, "2", "tester", "a canary", canary_run_id=runs["dead"], verify=False)
    weights, lines = [], []
    reaped = reap_stale(client, MODEL, 120, "tester", lines.append, set_weight=weights.append)
    assert sorted(reaped) == sorted([runs["dead"], runs["promoting"]]) and weights == [0.0]
    assert "candidate" not in aliases.current(client, MODEL)
    tags = client.get_run(runs["dead"]).data.tags
    assert tags["canary.phase"] == "aborted" and tags["canary.aborted"].startswith("controller gone since ")
    assert tags["outcome"] == "aborted" and client.get_run(runs["dead"]).info.status == "KILLED"
    # what the dead controller reached, and who it was, are kept (the reaper wrote step 0 and its own pid)
    assert (tags["canary.step"], tags["canary.controller"]) == ("1", "deadhost:4242")
    assert client.get_run(runs["dead"]).data.metrics["stopped_at_step"] == 1
    # a controller that died mid-promotion left the run `promoting`, which nothing reaped
    promoting = client.get_run(runs["promoting"]).data.tags["outcome.reason"]
    assert promoting.endswith(f"it was promoting v2: check production with `quantgate status {MODEL}`"), promoting
    assert len(lines) == 2 and all("recorded as aborted: controller gone since" in line for line in lines)
    assert sum("weight 0, candidate v2 cleared" in line for line in lines) == 1
    assert client.get_run(runs["alive"]).data.tags["canary.phase"] == "progressing"
    assert reap_stale(client, MODEL, 120, "tester", lines.append) == []  # once only
    client.set_tag(runs["alive"], "canary.phase", canary_status.Phase.ABORTED.value)  # leave no live run behind


def test_canary_run_gateway_refusals_are_one_line(project, tmp_path, monkeypatch):  # noqa: F811
    from click.testing import CliRunner

    from canary.commands import run

    monkeypatch.delenv("QUANTGATE_ADMIN_TOKEN", raising=False)
    gw = ["--gateway", "http://127.0.0.1:9"]
    for args, message, code in (
        (["--reuse", "1=http://127.0.0.1:9/v1"], "Error: --reuse is for a canary with its own servers", 2),
        (["--token-file", str(tmp_path / "none")], "Error: no admin token: $QUANTGATE_ADMIN_TOKEN is unset", 1),
    ):
        result = CliRunner().invoke(run, [MODEL, "2", "--by", "tester", *gw, *args])
        assert result.exit_code == code and result.output.splitlines()[-1].startswith(message), result.output
        assert "Traceback" not in result.output
    result = CliRunner().invoke(run, [MODEL, "2", "--by", "tester", *gw], env={"QUANTGATE_ADMIN_TOKEN": "ü"})
    assert result.exit_code == 1 and result.output.splitlines() == [
        "Error: $QUANTGATE_ADMIN_TOKEN has a non-ASCII character ('ü'), which an HTTP header cannot carry; set it to "
        "the gateway's admin token, or unset it to read --token-file"
    ], result.output
    (tmp_path / "token").write_text("t\n")
    result = CliRunner().invoke(run, [MODEL, "2", "--by", "tester", *gw, "--token-file", str(tmp_path / "token")])
    assert result.exit_code == 1 and "did not answer" in result.output, result.output
    assert "is `quantgate serve` running there?" in result.output
    assert "candidate" not in aliases.current(project, MODEL)  # nothing changed


def _token_files(tmp_path: Path) -> dict[str, str]:
    """A FIFO (with a thread that, should a regression open it for reading, writes nothing and closes it after 5 s:
    the test then fails instead of waiting forever), a broken symlink, a loop and a link to the FIFO, under
    `tmp_path`; each name -> what read_token says it is."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def unblock():
        time.sleep(5)
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO: nobody reads it, as it should be
        except OSError:
            pass

    threading.Thread(target=unblock, daemon=True).start()
    (tmp_path / "broken").symlink_to(tmp_path / "gone")
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "to_fifo").symlink_to("fifo")
    return {
        "fifo": "a named pipe (FIFO), not a regular file; give the file",
        "broken": f"a broken symlink: its target {tmp_path / 'gone'} does not exist; fix the link or give the file",
        "loop": "a symlink loop: its target loop leads back to it; fix the link or give the file",
        "to_fifo": "a symlink to a named pipe (FIFO) at fifo, not a regular file; give the file",
    }


def test_a_token_file_is_checked_only_when_it_is_read(project, tmp_path, monkeypatch):  # noqa: F811
    """With $QUANTGATE_ADMIN_TOKEN set the --token-file is never read, yet a FIFO or broken symlink there (say the
    default .quantgate/serve/admin.token) was refused at argument parsing ("Invalid value for '--token-file'")."""
    from canary.commands import run

    monkeypatch.delenv("QUANTGATE_ADMIN_TOKEN", raising=False)
    files = _token_files(tmp_path)
    gw = [MODEL, "2", "--by", "tester", "--gateway", "http://127.0.0.1:9"]
    for name in files:
        result = CliRunner().invoke(
            run, [*gw, "--token-file", str(tmp_path / name)], env={"QUANTGATE_ADMIN_TOKEN": "t" * 32}
        )
        assert result.exit_code == 1 and "did not answer" in result.output, result.output  # the gateway's, not F's
        assert "--token-file" not in result.output and str(tmp_path) not in result.output, result.output
    for name, what in files.items():  # unset or blank: the file is read, and refused unread in one line
        for env in ({}, {"QUANTGATE_ADMIN_TOKEN": " "}):
            result = CliRunner().invoke(run, [*gw, "--token-file", str(tmp_path / name)], env=env)
            unset = "blank" if env else "unset"
            assert result.exit_code == 1 and result.output.splitlines() == [
                f"Error: no admin token: $QUANTGATE_ADMIN_TOKEN is {unset} and --token-file {tmp_path / name} is "
                f"{what} the gateway wrote (WORK_DIR/admin.token)"
            ], result.output
    assert "candidate" not in aliases.current(project, MODEL)  # nothing changed


def test_an_empty_token_file_is_refused_only_where_it_would_be_read(project, tmp_path, monkeypatch):  # noqa: F811
    """`--token-file ""` (an unset shell variable) was refused at parsing ("the path is empty; give a file or
    folder") even with $QUANTGATE_ADMIN_TOKEN set, which --help says comes first: the file is then never read, so,
    like a FIFO there, never checked. Unset or blank, it is a usage error naming the option (exit 2) that says to
    give the file or leave the option out for its default."""
    from canary.commands import run

    monkeypatch.delenv("QUANTGATE_ADMIN_TOKEN", raising=False)
    gw = [MODEL, "2", "--by", "tester", "--gateway", "http://127.0.0.1:9", "--token-file", ""]
    result = CliRunner().invoke(run, gw, env={"QUANTGATE_ADMIN_TOKEN": "t" * 32})
    assert result.exit_code == 1 and "did not answer" in result.output, result.output  # the gateway's, not the option's
    assert "--token-file" not in result.output, result.output
    for env, unset in (({}, "unset"), ({"QUANTGATE_ADMIN_TOKEN": " "}, "blank")):
        result = CliRunner().invoke(run, gw, env=env)
        assert result.exit_code == 2 and result.output.splitlines()[-1] == (
            f"Error: Invalid value for '--token-file': the path is empty and $QUANTGATE_ADMIN_TOKEN is {unset}; give "
            "the file the gateway wrote (WORK_DIR/admin.token), or leave --token-file out to read "
            ".quantgate/serve/admin.token"
        ), result.output
    assert "candidate" not in aliases.current(project, MODEL)  # nothing changed


def test_stale_after_must_leave_room_for_the_heartbeat():
    with pytest.raises(ValidationError, match=r"(?s)stale_after_s.*>= 3 x check_interval_s"):
        CanaryPolicy(check_interval_s=5, stale_after_s=1)


@pytest.mark.parametrize("url", ["", "127.0.0.1:8001", "ftp://x", "http://", "http://127.0.0.1:99999", "http://[::1"])
def test_gateway_must_be_an_http_url(url):
    r = CliRunner().invoke(cli, ["canary", "run", "m", "2", "--by", "t", "--gateway", url])
    assert r.exit_code == 2 and "Traceback" not in r.output  # a bad argument, as click's own: before anything is read
    assert r.output.splitlines()[-1] == (
        f"Error: Invalid value for '--gateway': {url!r}: give the admin endpoint's http(s) URL with its host and port, "
        "e.g. http://127.0.0.1:8001 (`quantgate serve` prints it)"
    ), r.output


@pytest.mark.parametrize("flag", ["--evals", "--team-keys"])
def test_a_load_option_without_load_is_refused_in_one_line(flag, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("billing: sk-1\n")
    r = CliRunner().invoke(
        cli, ["canary", "run", "m", "2", "--by", "t", flag, str(keys if flag == "--team-keys" else tmp_path)]
    )
    assert r.exit_code == 2 and r.output.splitlines()[-1] == (
        f"Error: {flag} is for the --load-rps prompts; give --load-rps too, or leave {flag} out"
    ), r.output


def test_load_on_a_running_gateway_names_teams_by_its_team_header_and_the_team_keys(
    tmp_path, monkeypatch, example_evals
):
    """canary run --load-rps sent `x-team` whatever the gateway's limits.team_header, and no API key."""
    import canary.commands as commands
    import canary.controller as controller

    monkeypatch.chdir(tmp_path)
    Path("params.yaml").write_text("canary: {}\nlimits: {team_header: X-Tenant}\n")
    Path("keys.yaml").write_text("billing: sk-billing-1\n")
    Path("token").write_text("t" * 32 + "\n")
    sent = []

    def replay(url, prompts, rps, duration_s, **options):
        sent.append((url, {t.team for t in prompts}, options["team_header"], options["team_keys"]))

    def on_gateway(client, model, version, policy, by, admin, hooks):
        hooks.on_router("http://127.0.0.1:9")()  # start the load, then stop it
        return controller.Outcome("promoted", 1, 100.0, "test", "run1", ())

    monkeypatch.setattr(commands, "replay", replay)
    monkeypatch.setattr(controller, "run_canary_on_gateway", on_gateway)
    monkeypatch.setattr("registry.store.client", lambda existing=False: None)
    args = ["canary", "run", "m", "2", "--by", "t", "--gateway", "http://127.0.0.1:9", "--token-file", "token"]
    r = CliRunner().invoke(cli, [*args, "--load-rps", "1", "--evals", str(example_evals), "--team-keys", "keys.yaml"])
    assert r.exit_code == 0, r.output
    assert sent == [("http://127.0.0.1:9", {"billing", "search", "support"}, "x-tenant", {"billing": "sk-billing-1"})]
    assert "--team-keys has no key for search, support" in r.output
    assert (  # this gateway has no limits.team_keys_file: it reads X-Tenant alone
        "load: params.yaml limits.team_keys_file is null: the gateway names teams by the x-tenant header alone, so "
        "--team-keys changes nothing there"
    ) in r.output.splitlines()


def _gateway_load(
    tmp_path, monkeypatch, example_evals, params: str, keys: str | None, gateway: bool = True, max_tokens: int = 8
):
    """`canary run --load-rps` (on a gateway, or on the canary's own servers) with replay and the controller
    stubbed: (the CliRunner result, what replay was given)."""
    import canary.commands as commands
    import canary.controller as controller

    monkeypatch.chdir(tmp_path)
    Path("params.yaml").write_text(params)
    Path("token").write_text("t" * 32 + "\n")
    sent = []

    def replay(url, prompts, rps, duration_s, **options):
        sent.append((options["team_header"], options["team_keys"]))

    def on_gateway(client, model, version, policy, by, admin, hooks):
        hooks.on_router("http://127.0.0.1:9")()
        return controller.Outcome("promoted", 1, 100.0, "test", "run1", ())

    monkeypatch.setattr(commands, "replay", replay)
    monkeypatch.setattr(controller, "run_canary_on_gateway", on_gateway)
    monkeypatch.setattr(controller, "run_canary", lambda *a: pytest.fail("the canary's own servers were started"))
    monkeypatch.setattr("registry.store.client", lambda existing=False: None)
    args = ["canary", "run", "m", "2", "--by", "t", "--load-rps", "1", "--evals", str(example_evals)]
    args += ["--max-tokens", str(max_tokens)]
    if gateway:
        args += ["--gateway", "http://127.0.0.1:9", "--token-file", "token"]
    if keys is not None:
        Path("keys.yaml").write_text(keys)
        args += ["--team-keys", "keys.yaml"]
    return CliRunner().invoke(cli, args), sent


def test_team_keys_for_the_canarys_own_router_are_refused(tmp_path, monkeypatch, example_evals):
    """The canary's own router has no limits (every shadow sample anonymous): --team-keys there did nothing, and
    the run still said which teams had no key."""
    r, sent = _gateway_load(tmp_path, monkeypatch, example_evals, "canary: {}\n", "billing: sk-1\n", gateway=False)
    assert r.exit_code == 2 and sent == []
    assert r.output.splitlines()[-1] == (
        "Error: --team-keys is for a running gateway that tells teams by key (--gateway): the canary's own router "
        "counts every prompt as anonymous; give --gateway, or leave --team-keys out"
    ), r.output


def test_a_keyed_gateway_without_team_keys_or_with_a_wrong_key_is_named(tmp_path, monkeypatch, example_evals):
    """A gateway whose limits.team_keys_file tells teams by key ignores x-team: without --team-keys, or with a key
    whose digest that file does not list for its team, the load's prompts were anonymous there, silently."""
    import hashlib

    digest = hashlib.sha256(b"sk-billing-1").hexdigest()
    (tmp_path / "digests.yaml").write_text(f"billing: [{digest}]\n")
    params = "canary: {}\nlimits: {team_keys_file: digests.yaml, rate_limits: {teams: {billing: {rps: 1, burst: 1}}}}\n"
    r, sent = _gateway_load(tmp_path, monkeypatch, example_evals, params, None)
    assert r.exit_code == 0, r.output
    assert sent == [("x-team", None)]
    assert (
        "load: params.yaml limits.team_keys_file (digests.yaml) tells teams by API key, and the team header is "
        "ignored there: without --team-keys every prompt counts as anonymous"
    ) in r.output.splitlines()
    r, _ = _gateway_load(tmp_path, monkeypatch, example_evals, params, "billing: sk-billing-2\n")
    assert r.exit_code == 0, r.output
    assert (
        "load: --team-keys: billing's key is not one limits.team_keys_file (digests.yaml) lists for billing: its "
        "prompts count as anonymous (or as another team) there"
    ) in r.output.splitlines()
    r, _ = _gateway_load(tmp_path, monkeypatch, example_evals, params, "billing: sk-billing-1\n")
    assert r.exit_code == 0 and "team_keys_file" not in r.output, r.output
    # a digest file this machine cannot read is the gateway's to read: no note either way
    r, _ = _gateway_load(tmp_path, monkeypatch, example_evals, params.replace("digests", "elsewhere"), "billing: x\n")
    assert r.exit_code == 0 and "team_keys_file" not in r.output, r.output


def test_a_load_over_the_gateways_output_cap_is_refused_before_the_canary(tmp_path, monkeypatch, example_evals):
    """`canary run --gateway --load-rps 1 --max-tokens 64` on a gateway whose limits cap output at 32: every load
    request was refused (HTTP 400) before any server, so the canary ran its steps without load."""
    params = "canary: {}\nlimits:\n  team_header: x-team\n  max_output_tokens: 32\n"
    r, sent = _gateway_load(tmp_path, monkeypatch, example_evals, params, None, max_tokens=64)
    assert r.exit_code == 1 and sent == [], r.output
    assert r.output.splitlines()[-1] == (
        "Error: --max-tokens 64 is over the gateway's output cap of 32 tokens (limits.max_output_tokens, "
        "params.yaml:4): it would refuse every load request (HTTP 400); give --max-tokens 32 or less"
    )
    r, sent = _gateway_load(tmp_path, monkeypatch, example_evals, params, None, max_tokens=32)
    assert r.exit_code == 0 and sent == [("x-team", None)], r.output
    # the cap unset is its default, 512: named as such, not by the line of `limits:` (where it is not written)
    r, sent = _gateway_load(tmp_path, monkeypatch, example_evals, "canary: {}\nlimits: {}\n", None, max_tokens=600)
    assert r.exit_code == 1 and sent == [], r.output
    assert r.output.splitlines()[-1] == (
        "Error: --max-tokens 600 is over the gateway's output cap of 512 tokens (limits.max_output_tokens, its "
        "default: params.yaml does not set it): it would refuse every load request (HTTP 400); give --max-tokens "
        "512 or less"
    )


def test_a_gateway_url_with_spaces_is_used_stripped():
    from canary.commands import gateway_url

    assert gateway_url(" http://127.0.0.1:8001 ") == "http://127.0.0.1:8001"


def canary_runs(client) -> int:
    exp = client.get_experiment_by_name(EXPERIMENT)
    return len(client.search_runs([exp.experiment_id])) if exp else 0


def test_a_second_canary_of_the_model_is_refused_while_one_is_live(project, fake_fleet):  # noqa: F811
    client = project
    exp = store.experiment_id(client, EXPERIMENT, client.tracking_uri)
    live = client.create_run(exp, tags={"model": MODEL, "candidate_version": "3"}).info.run_id
    Status(client, live).set(Phase.PROGRESSING, step=2, weight=25.0)  # a fresh heartbeat
    g = registry_gateway(client, fake_fleet)
    try:
        before = canary_runs(client)
        with pytest.raises(
            QuantgateError, match=rf"a canary of {MODEL} is in progress: v3, run {live} \(progressing, step 2"
        ):
            run_canary_on_gateway(client, MODEL, "2", FAST, "tester", Admin(g.url, TOKEN), QUIET)
        assert canary_runs(client) == before and "candidate" not in aliases.current(client, MODEL)
    finally:
        g.stop()
        client.set_tag(live, "canary.phase", Phase.ABORTED.value)


def test_a_gateway_serving_another_model_is_refused_before_any_change(project):  # noqa: F811
    g = Gateway(lambda: {"stable": STABLE}, model="other-model").start()
    try:
        before = canary_runs(project)
        with pytest.raises(QuantgateError, match=f"serves other-model, not {MODEL}: give its own gateway"):
            run_canary_on_gateway(project, MODEL, "2", FAST, "tester", Admin(g.url, TOKEN), QUIET)
        assert canary_runs(project) == before and "candidate" not in aliases.current(project, MODEL)
    finally:
        g.stop()


def test_a_local_canary_without_a_serving_env_opens_no_run(project, tmp_path):  # noqa: F811
    from canary.controller import run_canary
    from quantgate.serving import ServeParams

    before = canary_runs(project)
    with pytest.raises(QuantgateError, match="serving python '/nonexistent/python' not found; run `make setup`"):
        run_canary(project, MODEL, "2", FAST, "tester", Local(ServeParams(python="/nonexistent/python"), tmp_path))
    assert canary_runs(project) == before and "candidate" not in aliases.current(project, MODEL)


def test_a_dead_reuse_url_or_a_bad_evals_folder_is_refused_before_any_run(project, tmp_path):  # noqa: F811
    """Both were found only after the canary's MLflow run was opened and `candidate` set (and, without
    --reuse, after three vLLM servers started); now one line and no change."""
    from canary.controller import run_canary
    from quantgate.serving import ServeParams

    before, dead = canary_runs(project), f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(QuantgateError, match=rf"^--reuse v1={dead}: no OpenAI server answers /models there \("):
        local = Local(ServeParams(python="/nonexistent/python"), tmp_path, reuse={"1": dead})
        run_canary(project, MODEL, "2", FAST, "t", local)
    args = ["canary", "run", MODEL, "2", "--by", "t", "--load-rps", "1", "--evals", str(tmp_path / "none")]
    result = CliRunner().invoke(cli, [*args, "--reuse", f"1={dead}"])
    assert result.exit_code == 2 and result.output.splitlines()[-1] == (  # a bad argument: click's usage error
        f"Error: Invalid value for '--evals': {tmp_path / 'none'} does not exist; give the folder of team eval sets "
        "(evals/); see evals/README.md"
    ), result.output
    assert canary_runs(project) == before and "candidate" not in aliases.current(project, MODEL)


def test_a_server_that_is_not_a_quantgate_admin_endpoint_is_refused_before_any_change(project):  # noqa: F811
    """`--gateway` at another HTTP server (an OpenAI server answering 200 JSON to any GET, or a 404 one):
    one line saying it is not `quantgate serve`'s admin endpoint, no canary run opened, no alias set."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    async def ok(request):
        return JSONResponse({"object": "list", "data": []})

    async def html(request):
        return PlainTextResponse("<html>hello</html>")

    app = Starlette(routes=[Route("/admin/state", ok), Route("/admin/html/admin/state", html)])
    before = canary_runs(project)
    with AppServer(app, "127.0.0.1", free_port(), grace_s=1) as server:
        for url, message in (
            (server.url, f"admin endpoint {server.url}/admin/state: no weight and fleet in the answer; it is not"),
            (f"{server.url}/admin/html", "/admin/state: the answer is not JSON; it is not a `quantgate serve` admin"),
            (f"{server.url}/elsewhere", "HTTP 404: Not Found; is that `quantgate serve`'s admin endpoint?"),
        ):
            with pytest.raises(QuantgateError, match="^[^\n]*$") as exc:
                run_canary_on_gateway(project, MODEL, "2", CanaryPolicy(), "tester", Admin(url, TOKEN), QUIET)
            assert message in str(exc.value), str(exc.value)
    assert canary_runs(project) == before and "candidate" not in aliases.current(project, MODEL)


def test_sigterm_to_canary_run_records_the_abort_and_clears_candidate(project, fake_fleet, tmp_path):  # noqa: F811
    """`kill PID` of a running `quantgate canary run` (here while it measures traffic at 0 %) stops
    it on its normal abort path, between registry writes: the run is recorded as aborted,
    `candidate` is cleared, exit 3 as any abort. (Without --gateway, the same path stops the vLLM
    servers it started; inside a server start SIGTERM interrupts at once.)"""
    import signal

    from canary.commands import run
    from canary.status import live_run

    g = registry_gateway(project, fake_fleet)
    (tmp_path / "token").write_text(TOKEN + "\n")
    killed = threading.Event()

    def kill_when_live():
        deadline = time.time() + 60
        while time.time() < deadline and not killed.is_set():
            try:
                live = live_run(project, MODEL, 120) is not None
                live = live and aliases.current(project, MODEL).get("candidate") == "2"
            except Exception:  # sqlite busy while the command writes: look again
                live = False
            if live:
                killed.set()
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.2)

    before = signal.signal(signal.SIGTERM, lambda *_: None)  # not conftest's handler: the command must set its own
    try:
        threading.Thread(target=kill_when_live, daemon=True).start()
        args = [MODEL, "2", "--by", "tester", "--gateway", g.url, "--token-file", str(tmp_path / "token")]
        result = CliRunner().invoke(run, args)
    finally:
        signal.signal(signal.SIGTERM, before)
        g.stop()
    assert killed.is_set(), result.output
    # stopped while waiting for the gateway's warm-up (an error before traffic, exit 1) or while
    # measuring traffic (an abort, exit 3): both one clean path, no registry write cut
    assert result.exit_code in (1, 3) and "Traceback" not in result.output and "ERROR" not in result.output
    assert "stopped by the operator (Ctrl-C or SIGTERM)" in result.output
    assert "candidate" not in aliases.current(project, MODEL)
    experiment = project.get_experiment_by_name(EXPERIMENT).experiment_id
    [r] = project.search_runs([experiment], order_by=["attributes.start_time DESC"], max_results=1)
    assert r.data.tags["canary.phase"] == "aborted"
    assert r.data.tags["outcome.reason"] == "stopped by the operator (Ctrl-C or SIGTERM)"


@pytest.mark.parametrize(("version", "decision"), [("2", "promoted"), ("3", "aborted")])
def test_a_local_canary_runs_through_its_own_in_process_gateway(project, fake_fleet, tmp_path, version, decision):  # noqa: F811
    """Without --gateway the canary starts a gateway in this process (gateway/inprocess.py) around its servers
    (here reused fake backends) and drives it through the admin endpoint, as it drives `quantgate serve`: the
    same `_candidate_steps`, the same outcome as on the fake standing gateway."""
    from canary.controller import run_canary
    from quantgate.serving import ServeParams

    reuse = {v: f"{fake_fleet[v].server.url}/v1" for v in ("1", "2", "3")}
    local = Local(
        ServeParams(python="/nonexistent/python"),  # every version reused: no server starts
        tmp_path,
        router_params=RouterParams(shadow_fraction=1.0, shadow_compare_words=2),
        reuse=reuse,
    )
    stop, lines = threading.Event(), []

    def on_router(url):
        t = load(url, stop)
        return lambda: (stop.set(), t.join())

    traffic = Traffic(20, 0.5, 1.0, "test", shadow_fraction=1.0)
    try:
        outcome = run_canary(
            project, MODEL, version, FAST, "tester", local, Hooks(lines.append, on_router=on_router, traffic=traffic)
        )
        now = aliases.current(project, MODEL)
        assert outcome.decision == decision, (outcome.reason, lines)
        assert "candidate" not in now and now.get("production") == ("2" if decision == "promoted" else None)
        router_line = next(line for line in lines if line.startswith("canary: router at http://127.0.0.1:"))
        warm = next(line for line in lines if line.startswith(f"canary: v{version} is warm on the gateway "))
        assert warm.split()[-1] == router_line.split()[3]  # the admin state names the gateway's public URL
        assert fake_fleet[version].seen  # the candidate got traffic through the in-process router
        idle = "3" if version == "2" else "2"  # reused but not this canary's: said, never silently dropped
        assert f"canary: --reuse {idle} not used: this canary serves only v1, v{version}" in lines
        if decision == "aborted":
            assert outcome.step == 1 and "error_rate" in outcome.reason
    finally:
        if aliases.current(project, MODEL).get("production"):
            aliases.rollback(project, MODEL, "tester", "test: back to the fallback", to="fallback")
