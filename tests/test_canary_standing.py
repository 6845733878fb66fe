"""The standing fleet's plan and reconcile loop, with the registry's aliases and the vLLM servers
replaced by a dict and `sleep` processes (the real ones: tests/test_serve_e2e.py)."""

import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import gateway.fleet as standing
from gateway.fleet import AdminAddress, Fleet, FleetParams, load_fleet_params, plan, process_alive
from gateway.router import Backend
from gateway.serve import PIDS, reap_orphans
from quantgate.errors import QuantgateError
from quantgate.serving import ServeParams, Server, Watch

P = FleetParams()


@pytest.mark.parametrize(
    "now,params,expected",
    [
        ({"fallback": "1"}, P, [("1", "serving")]),
        (
            {"production": "3", "fallback": "1", "previous": "2"},
            P,
            [("3", "serving"), ("1", "fallback"), ("2", "previous")],
        ),
        (  # a candidate is warmer than previous; the cap keeps the first three
            {"production": "3", "fallback": "1", "previous": "2", "candidate": "4"},
            P,
            [("3", "serving"), ("1", "fallback"), ("4", "candidate")],
        ),
        ({"production": "3", "fallback": "1", "previous": "1"}, P, [("3", "serving"), ("1", "fallback")]),
        (
            {"production": "3", "fallback": "1", "previous": "2"},
            FleetParams(keep_previous=False),
            [("3", "serving"), ("1", "fallback")],
        ),
        ({"production": "3", "fallback": "1"}, FleetParams(max_servers=1), [("3", "serving")]),
        ({}, P, []),
    ],
)
def test_plan_orders_dedupes_and_caps(now, params, expected):
    assert plan(now, params) == expected


def test_params_block_loads_and_names_a_bad_field(tmp_path):
    assert load_fleet_params().max_servers == 3
    bad = tmp_path / "params.yaml"
    bad.write_text("fleet:\n  max_servers: 0\n")
    with pytest.raises(QuantgateError, match=r"params.yaml:2: fleet.max_servers"):
        load_fleet_params(bad)


def sleep_server(stack, version: str, log_path: Path = Path("no.log")) -> tuple[Backend, Server]:
    """A stand-in for a version's vLLM server: a `sleep` process in its own group, watched as
    vllm_server watches one, stopped with `stack`."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    server = Server(f"http://127.0.0.1:1/v{version}", f"m-v{version}", log_path, proc.pid, Watch(proc, log_path))
    stack.callback(lambda: (server.watch.stopping(), proc.kill(), proc.wait()))
    return Backend(server.base_url, server.name, f"v{version}"), server


class Fakes:
    """Aliases as a dict; each version's registered digest in `digests`; verifying writes the
    destination folder (or fails for versions in `fail`); each started 'server' is a `sleep`
    process in its own group (or fails to start for versions in `fail_start`)."""

    def __init__(self, monkeypatch, fail: set[str] | None = None, fail_start: set[str] | None = None):
        self.aliases: dict[str, str] = {}
        self.digests: dict[str, str] = {}
        self.started: list[str] = []
        self.verified: list[str] = []
        self.fail, self.fail_start = fail or set(), fail_start or set()
        self.failed_starts = 0
        self.inflight: dict[str, int] = {}
        monkeypatch.setattr(standing.aliases, "current", lambda client, model: dict(self.aliases))
        monkeypatch.setattr(standing.versions, "require_version", self.require_version)
        monkeypatch.setattr(standing, "verify_version", self.verify_version)
        monkeypatch.setattr(standing, "open_server", self.open_server)

    def require_version(self, client, model, version):
        return SimpleNamespace(tags={"weights_sha256": self.digests.get(version, "d" * 64)})

    def verify_version(self, client, model, version, dest):
        self.verified.append(version)
        if version in self.fail:
            raise QuantgateError(f"{model} v{version}: weights do not verify")
        (dest / "model").mkdir(parents=True)
        return dest / "model"

    def open_server(self, stack, source, version, params, role, log, verified):
        assert verified.is_dir()  # standing.py verified the weights first
        if version in self.fail_start:  # as vLLM's log says it: a pid (and a time) that differ per try
            self.failed_starts += 1
            raise QuantgateError(
                f"v{version}: the vLLM server exited during start-up: ERROR [pid {self.failed_starts}]"
            )
        self.started.append(version)
        return (*sleep_server(stack, version), verified)

    def fleet(self, tmp_path, **params) -> Fleet:
        p = FleetParams(**{"drain_s": 1.0, "restart_backoff_s": 0.0, **params})
        return Fleet(
            None,
            "m",
            ServeParams(),
            p,
            tmp_path,
            log=lambda line: None,
            inflight=lambda b: self.inflight.get(b.label, 0),
        )


def test_reconcile_starts_the_plan_and_resolve_routes_production(monkeypatch, tmp_path):
    f = Fakes(monkeypatch)
    f.aliases = {"production": "3", "fallback": "1", "previous": "2"}
    fleet = f.fleet(tmp_path)
    try:
        fleet.reconcile(max_starts=1)
        assert f.started == ["3"] and fleet.resolve()["stable"].label == "v3" and fleet.resolve()["shadow"] is None
        fleet.reconcile()
        assert f.started == ["3", "1", "2"]
        r = fleet.resolve()
        assert (r["stable"].label, r["shadow"].label, r["candidate"]) == ("v3", "v1", None)
        assert {v: s["why"] for v, s in fleet.status().items()} == {"3": "serving", "1": "fallback", "2": "previous"}
        f.aliases = {"production": "2", "fallback": "1"}  # a rollback to a warm version: no start
        assert fleet.resolve()["stable"].label == "v2"
        fleet.reconcile()
        assert f.started == ["3", "1", "2"] and set(fleet.status()) == {"2", "1"}
    finally:
        fleet.close()
    assert fleet.status() == {}


def test_a_cold_production_is_served_by_previous_until_it_is_warm(monkeypatch, tmp_path):
    f = Fakes(monkeypatch)
    f.aliases = {"production": "3", "fallback": "1", "previous": "2"}
    fleet = f.fleet(tmp_path)
    try:
        fleet.reconcile()
        f.aliases = {"production": "4", "fallback": "1", "previous": "3"}  # promoted a cold v4
        assert fleet.resolve()["stable"].label == "v3"
        fleet.reconcile()
        assert fleet.resolve()["stable"].label == "v4"
    finally:
        fleet.close()


def test_a_dead_server_leaves_routing_and_is_restarted(monkeypatch, tmp_path):
    f = Fakes(monkeypatch)
    f.aliases = {"production": "3", "fallback": "1"}
    fleet = f.fleet(tmp_path)
    try:
        fleet.reconcile()
        pid = fleet.status()["3"]["pid"]
        os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        fleet.reconcile()
        s = fleet.status()["3"]
        assert s["pid"] != pid and s["restarts"] == 1 and f.started == ["3", "1", "3"]
        assert f.verified == ["3", "1"]  # restarted from the weights verified before: not hashed again
    finally:
        fleet.close()


def test_a_version_that_cannot_be_served_is_passed_over_then_retried(monkeypatch, tmp_path):
    f = Fakes(monkeypatch, fail={"3"})
    f.aliases = {"production": "3", "fallback": "1"}
    fleet = f.fleet(tmp_path, restart_backoff_s=60.0)
    try:
        fleet.reconcile(max_starts=1)  # v3 fails: nothing warm yet
        with pytest.raises(QuantgateError, match="no vLLM server is warm"):
            fleet.resolve()
        fleet.reconcile(max_starts=1)  # v3 is in its back-off: the fallback is started
        assert f.started == ["1"] and fleet.resolve()["stable"].label == "v1"
        assert "weights do not verify" in fleet.failures["3"].why
    finally:
        fleet.close()


def test_a_failing_start_is_verified_once_and_backs_off_exponentially(monkeypatch, tmp_path):
    f = Fakes(monkeypatch, fail_start={"3"})
    f.aliases = {"production": "3", "fallback": "1"}
    now, lines = [0.0], []
    params = FleetParams(restart_backoff_s=5, restart_backoff_max_s=30)
    fleet = Fleet(None, "m", ServeParams(), params, tmp_path, log=lines.append, clock=lambda: now[0])
    try:
        tried_at = []
        for t in range(200):  # 200 s, one pass a second
            now[0] = float(t)
            before = fleet.failures.get("3")
            fleet.reconcile()
            if fleet.failures["3"].tries != (before.tries if before else 0):
                tried_at.append(t)
        assert tried_at == [0, 5, 15, 35, 65, 95, 125, 155, 185]  # +5, +10, +20, then the 30 s cap
        assert f.verified.count("3") == 1 and f.failed_starts == 9  # weights hashed once, not once per try
        assert fleet.next_retry_in() == 215 - 199 and f.started == ["1"]
        assert [line for line in lines if line.startswith("v3")] == [
            "v3: weights verified against the registry (weights_sha256 dddddddddddd...)",
            "v3: not served: v3: the vLLM server exited during start-up: ERROR [pid 1]; next try in 5 s, "
            "then after twice as long each time, up to 30 s",
        ]  # one line when it starts failing, none per try (numbers in the reason aside)
        f.digests["3"], f.fail = "e" * 64, {"3"}  # new weights registered under v3: verified again, and bad
        now[0] = 215.0
        fleet.reconcile()
        assert f.verified.count("3") == 2 and fleet.failures["3"].tries == 10
        assert lines[-1] == "v3: still not served after 10 tries, now: m v3: weights do not verify; next try in 30 s"
        f.fail, f.fail_start = set(), set()
        now[0] = 245.0
        fleet.reconcile()
        assert f.started == ["1", "3"] and "3" not in fleet.failures and fleet.next_retry_in() is None
        assert lines[-1] == "v3: serving after 10 failed start(s)"
    finally:
        fleet.close()


def test_an_unplanned_server_is_drained_before_it_stops(monkeypatch, tmp_path):
    f = Fakes(monkeypatch)
    f.aliases = {"production": "3", "fallback": "1"}
    fleet = f.fleet(tmp_path, drain_s=0.6)
    try:
        fleet.reconcile()
        f.aliases = {"fallback": "1"}
        f.inflight["v3"] = 1  # a request that never ends: the drain waits drain_s, then stops
        t0 = time.monotonic()
        fleet.reconcile()
        assert 0.6 <= time.monotonic() - t0 < 3 and set(fleet.status()) == {"1"}
        f.aliases = {"production": "3", "fallback": "1"}
        fleet.reconcile()
        f.inflight["v3"] = 0
        f.aliases = {"fallback": "1"}
        t0 = time.monotonic()
        fleet.reconcile()  # nothing in flight: stopped at once
        assert time.monotonic() - t0 < 0.5
    finally:
        fleet.close()


def test_reap_orphans_kills_only_recorded_vllm_groups(tmp_path):
    leader = subprocess.Popen(
        ["bash", "-c", "exec -a vllm.entrypoints.openai.api_server sleep 300"], start_new_session=True
    )
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        for version, proc in (("1", leader), ("2", other)):
            (tmp_path / f"v{version}").mkdir()
            (tmp_path / f"v{version}" / PIDS).write_text(f"{proc.pid}\n")
        time.sleep(0.2)
        assert reap_orphans(tmp_path, log=lambda line: None) == 1
        assert leader.wait(timeout=5) == -signal.SIGKILL and other.poll() is None
        assert not list(tmp_path.glob(f"v*/{PIDS}"))
    finally:
        for p in (leader, other):
            p.kill()
            p.wait()


def test_each_new_server_takes_the_least_used_core_set(monkeypatch, tmp_path):
    f = Fakes(monkeypatch)
    f.aliases = {"production": "3", "fallback": "1", "previous": "2"}
    fleet = f.fleet(tmp_path)
    try:
        fleet.reconcile()
        assert {v: s["cores"] for v, s in fleet.status().items()} == {"3": "0", "1": "1", "2": "0"}
        os.killpg(fleet.status()["3"]["pid"], signal.SIGKILL)
        time.sleep(0.2)
        fleet.reconcile()  # v3 restarts beside v1 (core 1) and v2 (core 0): a tie, the first set
        assert fleet.status()["3"]["cores"] == "0"
        fleet.close()
        fleet = f.fleet(tmp_path, cpu_core_sets=[])
        fleet.reconcile()
        assert {s["cores"] for s in fleet.status().values()} == {None}
    finally:
        fleet.close()


def test_the_gateway_serves_its_admin_endpoint_with_a_token(monkeypatch, tmp_path):
    """run_gateway with `sleep` servers: the admin endpoint next to the public one, its token in
    WORK_DIR/admin.token (0600), the fleet's servers alive in /admin/state, the weight settable."""
    import re
    import stat
    import threading

    import httpx

    from gateway import serve as gateway
    from gateway.limits import Limits

    monkeypatch.delenv("QUANTGATE_ADMIN_TOKEN", raising=False)
    monkeypatch.setattr(gateway, "tokenizer_counter", lambda model_dir: lambda path, body: 1)
    f = Fakes(monkeypatch)
    f.aliases = {"fallback": "1", "candidate": "2"}
    for v in f.aliases.values():
        (tmp_path / f"v{v}").mkdir()  # open_server makes it for a real server (pid files go there)
    params = FleetParams(port=0, admin={"port": 0}, restart_backoff_s=0.0, poll_s=0.1)
    lines, stop, ready = [], threading.Event(), threading.Event()
    t = threading.Thread(
        target=gateway.run_gateway,
        args=(None, "m", gateway.Settings(ServeParams(), params, Limits()), tmp_path),
        kwargs={"log": lines.append, "stop": stop, "on_ready": lambda url: ready.set()},
        daemon=True,
    )
    t.start()
    try:
        assert ready.wait(30), lines
        admin = next(re.search(r"admin endpoint at (\S+)/admin", line) for line in lines if "admin endpoint" in line)
        token_file = tmp_path / "admin.token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        auth = {"Authorization": f"Bearer {token_file.read_text().strip()}"}
        assert httpx.get(f"{admin[1]}/admin/state").status_code == 401
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            s = httpx.get(f"{admin[1]}/admin/state", headers=auth).json()
            if s["candidate"] == "v2":
                break
            time.sleep(0.1)
        assert (s["stable"], s["candidate"], s["weight"]) == ("v1", "v2", 0)
        assert s["fleet"]["2"]["alive"] and s["fleet"]["2"]["why"] == "candidate" and s["url"].startswith("http")
        assert httpx.put(f"{admin[1]}/admin/weight", json={"percent": 30}, headers=auth).json() == {"weight": 30}
        assert s["shadow_fraction"] == params.router.shadow_fraction  # what a canary's plan counts on
        assert s["shadow_teams"] == 1  # params.yaml's limits name no team of their own: one shadow sample
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive() and "serve: every server stopped" in lines


def test_serve_reaps_dead_canaries_first_and_serves_when_the_registry_cannot_say(monkeypatch, tmp_path):
    """`quantgate serve` records canaries whose controller died as aborted before its gateway starts (the
    gateway knows nothing of canaries); a registry it cannot read for that is said, and it serves anyway."""
    from click.testing import CliRunner

    import canary.status
    import gateway.serve
    from cli.main import cli
    from registry import store

    said = []
    monkeypatch.setattr(store, "client", lambda existing=False: "the registry")
    monkeypatch.setattr(gateway.serve, "run_gateway", lambda client, model, *a, **k: said.append(("serve", model)))
    for reap in (lambda *a, **k: said.append(("reap", a[1], a[3])), lambda *a, **k: 1 / 0):
        monkeypatch.setattr(canary.status, "reap_stale", reap)
        result = CliRunner().invoke(cli, ["serve", "m", "--work-dir", str(tmp_path)])
        assert result.exit_code == 0, result.output
    assert said == [("reap", "m", "quantgate serve"), ("serve", "m"), ("serve", "m")]
    assert "could not check for canaries left by a dead controller: ZeroDivisionError" in result.output


def test_serve_names_a_team_keys_file_that_is_no_file_at_its_params_line(monkeypatch, tmp_path):
    """`quantgate serve` with params.yaml limits.team_keys_file a broken symlink, a FIFO, a folder, ... said only
    "Error: limits.team_keys_file: <path> is not a file"; it names what the path is and params.yaml's line, before
    any server starts (test_canary_limits.py has every kind of path)."""
    import signal

    from click.testing import CliRunner

    import canary.status
    from cli.main import cli
    from quantgate.params import key_lines
    from registry import store
    from tests.test_canary_analysis import write_params
    from tests.test_canary_limits import no_keys_files

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(store, "client", lambda existing=False: "the registry")
    monkeypatch.setattr(canary.status, "reap_stale", lambda *a, **k: None)
    monkeypatch.setattr(signal, "signal", lambda sig, handler: None)  # serve's SIGTERM handler: not this process's
    files = no_keys_files(tmp_path)
    for name in ("broken", "fifo", "to_fifo", "folder"):
        write_params(tmp_path, "limits", team_keys_file=name)
        line = key_lines(Path("params.yaml"))[("limits", "team_keys_file")]
        args = ["serve", "m", "--port", "0", "--admin-port", "0", "--work-dir", str(tmp_path / "work")]
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 1 and result.output.splitlines() == [
            f"Error: params.yaml:{line}: limits.team_keys_file: {name} is {files[name]}give the YAML of API-key "
            "digests per team, or null"
        ], result.output


@pytest.mark.parametrize(
    "args, said",
    [
        (["--host", ""], "Invalid value for '--host': must not be empty or blank: give an address, e.g. 127.0.0.1"),
        (["--host", " "], "Invalid value for '--host': must not be empty or blank"),
        (
            ["--port", "18555", "--admin-port", "18555"],
            "--port and --admin-port are both 18555: the gateway and its admin endpoint need a port each",
        ),
    ],
)
def test_serve_options_that_cannot_work_are_usage_errors_before_params_or_registry(args, said, monkeypatch, tmp_path):
    """The README's exit 2: `serve --host ''` and `--port P --admin-port P` exited 1, after params.yaml and the
    registry were read (a folder without them said "params.yaml: file not found" instead)."""
    from click.testing import CliRunner

    from cli.main import cli

    monkeypatch.chdir(tmp_path)  # no params.yaml, no registry: neither is read
    result = CliRunner().invoke(cli, ["serve", "m", *args])
    assert result.exit_code == 2 and said in result.output, result.output
    assert "params.yaml" not in result.output, result.output


def test_ctrl_c_stops_serve_with_0_and_another_command_with_clicks_aborted_1(monkeypatch, tmp_path):
    """The README's exit codes: Ctrl-C in a command is click's `Aborted!`, exit 1 (not 130, as in a DVC stage);
    `quantgate serve` runs until Ctrl-C or SIGTERM, so that is its normal stop: `serve: stopped`, exit 0."""
    import signal

    from click.testing import CliRunner

    import canary.status
    import gateway.serve
    from cli.main import cli
    from registry import store

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "client", lambda existing=False: "the registry")
    monkeypatch.setattr(canary.status, "reap_stale", lambda *a, **k: None)
    monkeypatch.setattr(gateway.serve, "run_gateway", ctrl_c)
    monkeypatch.setattr(signal, "signal", lambda sig, handler: None)  # serve's SIGTERM handler: not this process's
    result = CliRunner().invoke(cli, ["serve", "m", "--work-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == "serve: stopped (Ctrl-C or SIGTERM)", result.output
    monkeypatch.setattr(store, "client", ctrl_c)  # Ctrl-C while the registry is read
    result = CliRunner().invoke(cli, ["status", "m"])
    assert result.exit_code == 1 and result.output.splitlines()[-1] == "Aborted!", result.output


def test_warm_first_passes_a_failing_serving_build_over_at_once(monkeypatch, tmp_path):
    import threading

    from gateway.serve import warm_first

    f = Fakes(monkeypatch, fail={"3"})
    f.aliases = {"production": "3", "fallback": "1"}
    fleet = f.fleet(tmp_path, restart_backoff_s=60.0)
    try:
        t0 = time.monotonic()
        assert warm_first(fleet, fleet.params, threading.Event())
        assert time.monotonic() - t0 < 5 and set(fleet.status()) == {"1"}
    finally:
        fleet.close()


def test_ports_are_checked_before_any_server_starts(tmp_path):
    import socket

    from gateway.serve import check_bindable

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(QuantgateError, match=rf"^fleet.port: cannot listen on 127.0.0.1:{port} \(.*\); free it"):
            check_bindable("127.0.0.1", port, "fleet")
    # a bad host is the host's fault, not the port's (once "fleet.port: ... free it or pick another")
    with pytest.raises(QuantgateError, match=r"^fleet.host: '999.1.1.1' does not resolve to an address \(.*\); give"):
        check_bindable("999.1.1.1", 0, "fleet")  # port 0: the host is checked
    with pytest.raises(QuantgateError, match=r"^fleet.admin.host: '192.0.2.1' is no address of this machine .*"):
        check_bindable("192.0.2.1", 0, "fleet.admin")  # TEST-NET-1: resolves, but no interface here has it
    with pytest.raises(QuantgateError, match=r"\(params.yaml fleet.admin.host\)$"):  # --host is the gateway's only
        check_bindable("256.1.1.1", 0, "fleet.admin")
    # --host '' (params are not re-validated): it bound every interface and said http://:8000
    with pytest.raises(
        QuantgateError, match=r"^fleet.host is empty; give an address, .*\(params.yaml fleet.host or --host\)$"
    ):
        check_bindable("", 0, "fleet")
    for bad_host in ({"host": " "}, {"admin": {"host": ""}}):
        with pytest.raises(ValueError, match="must not be empty or blank: give an address"):
            FleetParams.model_validate(bad_host)
    from gateway.limits import Limits
    from gateway.serve import Settings, run_gateway
    from quantgate.serving import ServeParams

    same = FleetParams().model_copy(
        update={"port": 18999, "admin": AdminAddress(port=18999)}
    )  # as --port, --admin-port
    with pytest.raises(QuantgateError, match="fleet.port and fleet.admin.port are both 18999: .* a port each"):
        run_gateway(None, "m", Settings(ServeParams(), same, Limits()), tmp_path / "work", log=lambda _: None)
    bad = tmp_path / "params.yaml"
    bad.write_text("fleet:\n  port: 8001\n")
    with pytest.raises(QuantgateError, match="fleet: .*admin.port 8001 is also fleet.port"):
        load_fleet_params(bad)


def test_an_ipv6_host_is_served_on_ipv6():
    """fleet.host '::1' was refused as "no address of this machine": the gateway bound IPv4 sockets only."""
    import socket

    import httpx

    from gateway.serve import check_bindable
    from gateway.server import AppServer

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    check_bindable("::1", 0, "fleet")

    async def app(scope, receive, send):
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
        elif scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})

    server = AppServer(app, host="::1").start()
    try:
        assert server.url.startswith("http://[::1]:")
        assert httpx.get(server.url, trust_env=False).text == "ok"
    finally:
        server.stop()


def test_a_host_name_only_ipv6_knows_is_bound_on_ipv6_and_a_dual_name_stays_ipv4(monkeypatch):
    """fleet.host naming a host with only an IPv6 address (ip6-localhost) was "no address of this machine": names
    were resolved for IPv4 only. A name with both (localhost) keeps its IPv4 address, as before."""
    import socket

    from gateway.serve import check_bindable
    from gateway.server import AppServer
    from quantgate.serving import bind_address

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    v6 = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0))
    v4 = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0))
    real = socket.getaddrinfo
    names = {"v6only.test": [v6], "dual.test": [v6, v4]}
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: names.get(host) or real(host, *a, **k))
    assert bind_address("v6only.test", 0) == (socket.AF_INET6, ("::1", 0, 0, 0))
    assert bind_address("dual.test", 0) == (socket.AF_INET, ("127.0.0.1", 0))
    check_bindable("v6only.test", 0, "fleet")  # raised: 'v6only.test' is no address of this machine

    async def app(scope, receive, send):  # lifespan only: the test connects, it sends no request
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})

    with AppServer(app, host="v6only.test") as server:  # raised: cannot listen on v6only.test:0
        socket.create_connection(("::1", server.port), timeout=5).close()  # it listens on ::1


def test_serve_outside_the_project_says_where_it_looked(tmp_path, monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    with pytest.raises(QuantgateError) as exc:
        load_fleet_params(Path("params.yaml"))
    assert str(exc.value) == f"params.yaml: file not found in {tmp_path}; run from the project folder"


def test_a_params_yaml_that_is_a_folder_is_named_as_one(tmp_path, monkeypatch):
    from pathlib import Path

    from click.testing import CliRunner

    from cli.main import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").mkdir()
    with pytest.raises(QuantgateError) as exc:
        load_fleet_params(Path("params.yaml"))
    assert str(exc.value) == "params.yaml: is a folder, not a file; give the YAML file (move the folder away)"
    res = CliRunner().invoke(cli, ["status"])  # not "no params.yaml": there is one, a folder
    assert res.exit_code != 0 and "Traceback" not in res.output, res.output
    assert "params.yaml: is a folder, not a file" in res.output, res.output


def test_a_params_yaml_that_is_a_broken_link_is_named_as_one(tmp_path, monkeypatch):
    """A params.yaml linked to a file that is gone said "file not found in <here>; run from the project folder"
    (status: "no params.yaml in <here>"), though the folder is the project's and its link is what is wrong."""
    from pathlib import Path

    from click.testing import CliRunner

    from cli.main import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").symlink_to("shared/params.yaml")
    said = "params.yaml is a broken symlink: its target shared/params.yaml does not exist; fix the link or give the "
    with pytest.raises(QuantgateError) as exc:
        load_fleet_params(Path("params.yaml"))
    assert str(exc.value) == said + "YAML file"
    res = CliRunner().invoke(cli, ["status"])
    assert res.exit_code == 1 and res.output.splitlines()[-1] == f"Error: {said}YAML file", res.output


@pytest.mark.parametrize(
    "text, key",
    [
        ("canary:\n  max_step_s: .inf\n", "2: canary.max_step_s"),  # once: the plan's feasibility check skipped
        ("canary:\n  measure_s: .inf\n", "2: canary.measure_s"),  # once: traffic measured forever
        ("canary:\n  steps: [10, .nan]\n", "2: canary.steps.1"),
        ("limits:\n  rate_limits:\n    default: {rps: .inf, burst: 10}\n", "3: limits.rate_limits.default.rps"),
        ("search:\n  max_bits_per_weight: .inf\n", "2: search.max_bits_per_weight"),
    ],
)
def test_an_infinite_or_nan_number_in_params_is_refused_naming_the_key(tmp_path, text, key):
    from canary.policy import load_policy
    from gateway.limits import load_limits
    from quantgate.params import load_block
    from quantgate.search_params import SearchParams

    path = tmp_path / "params.yaml"
    path.write_text(text)
    load = {"canary": load_policy, "limits": load_limits, "search": lambda p: load_block("search", SearchParams, p)}
    with pytest.raises(QuantgateError) as exc:
        load[key.split(": ")[1].split(".")[0]](path)
    assert str(exc.value).startswith(f"{path}:{key}: Input should be a finite number; got float "), exc.value


@pytest.mark.parametrize(
    "fleet, message",
    [
        ("  servers: {serving: {port: 8000}}\n", "servers.serving.port 8000 is also fleet.port"),
        ("  servers: {warm: {port: 8001}}\n", "servers.warm.port 8001 is also admin.port"),
        (
            "  servers: {serving: {port: 9000}, warm: {port: 9000}}\n",
            "servers.warm.port 9000 is also servers.serving.port",
        ),
        ("  servers: {warm: {port: 9001}}\n", r"servers.warm.port 9001: up to 2 warm servers run at once"),
    ],
)
def test_vllm_server_ports_that_clash_are_refused_before_any_server(tmp_path, fleet, message):
    """Once found only after a vLLM server had taken minutes to start (fleet.servers.*.port)."""
    bad = tmp_path / "params.yaml"
    bad.write_text("fleet:\n" + fleet)
    with pytest.raises(QuantgateError, match=rf"^{bad}:1: fleet: {message}"):
        load_fleet_params(bad)
    ok = tmp_path / "ok.yaml"
    ok.write_text("fleet:\n  max_servers: 2\n  servers: {serving: {port: 9000}, warm: {port: 9001}}\n")
    assert load_fleet_params(ok).servers.warm.port == 9001  # one warm server: a fixed port serves it


def test_serve_options_are_checked_with_the_fleet_blocks_rules(tmp_path):
    from gateway.fleet import FleetServers, ServerOverride
    from gateway.limits import Limits
    from gateway.serve import Settings, run_gateway
    from quantgate.serving import ServeParams, free_port

    port = free_port()  # --port P after params.yaml was read, where servers.serving.port is P
    clash = FleetParams(servers=FleetServers(serving=ServerOverride(port=port))).model_copy(update={"port": port})
    with pytest.raises(QuantgateError) as exc:
        run_gateway(None, "m", Settings(ServeParams(), clash, Limits()), tmp_path / "work", log=lambda _: None)
    assert str(exc.value) == (
        f"fleet: servers.serving.port {port} is also fleet.port; give each its own port, or 0 for a free one "
        "(params.yaml, --port, --admin-port)"
    )


def test_serve_of_a_model_not_registered_writes_nothing(tmp_path, monkeypatch):
    """`serve nosuchmodel` once wrote WORK_DIR/admin.token (a live gateway's, in a shared work dir) first."""
    from gateway.limits import Limits
    from gateway.serve import Settings, run_gateway
    from registry import store

    monkeypatch.delenv("QUANTGATE_ADMIN_TOKEN", raising=False)
    client = store.client(f"sqlite:///{tmp_path}/mlflow.db")
    params = FleetParams(port=0, admin=AdminAddress(port=0))
    with pytest.raises(QuantgateError, match=r"^model 'nosuchmodel' is not registered at .*check the name"):
        run_gateway(client, "nosuchmodel", Settings(ServeParams(), params, Limits()), tmp_path / "work", log=print)
    assert not (tmp_path / "work" / "admin.token").exists()
