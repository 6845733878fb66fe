"""`quantgate serve MODEL`: the standing OpenAI gateway in front of the fleet that follows the registry.

1. Stop vLLM servers a killed earlier gateway left behind (their process groups are recorded
   under the work dir; `reap_orphans`).
2. Start the serving build's server first (production, else fallback: gateway.fleet.plan),
   so the gateway listens as soon as one build answers; a serving build that cannot be served
   (weights that do not verify, a server that does not start) is passed over for the next.
3. Listen (gateway.router.Router with the fleet's resolve(): production traffic, retried on the
   fp16 `fallback` when production fails; a canary's split when `candidate` is set; the
   `limits` of params.yaml: 400 over the context ceiling or output cap, 429 over a team's rate) and
   reconcile every `fleet.poll_s` until stopped (SIGTERM, Ctrl-C, or `stop`): warm the other
   planned builds, restart dead servers, drain and stop unplanned ones. With an `mlflow server`
   registry (`fleet.webhook: auto`) it registers an MLflow webhook for alias changes first
   (gateway/webhook.py), and each delivery runs the reconcile pass and the router's resolve at once.
4. On the way out, stop taking requests, delete the webhook, then stop every server.
/health adds the fleet ({version: url, pid, why, cores, restarts, up_s}) and the gateway's pid; /metrics adds
quantgate_fleet_servers{version,why} and quantgate_fleet_restarts{version}.
Next to the public endpoint, the admin endpoint (gateway/admin.py) at `fleet.admin` (loopback by
default, a bearer token: $QUANTGATE_ADMIN_TOKEN or WORK_DIR/admin.token) lets a canary controller
in another process set the split and read the samples. A gateway starts at 0 % to the candidate;
the `quantgate serve` command records canary runs whose controller stopped beating as aborted before it
starts one (canary.status.reap_stale: the gateway knows nothing of canaries), and a live controller
resumes its step on the restarted gateway.
"""

from __future__ import annotations

import errno
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Gauge
from pydantic import ValidationError

from gateway.admin import admin_app, admin_token
from gateway.fleet import Fleet, FleetParams, process_alive
from gateway.limits import Limiter, Limits, tokenizer_counter
from gateway.router import Router
from gateway.server import AppServer, RouterServer
from gateway.webhook import PATH as WEBHOOK_PATH
from gateway.webhook import Receiver, Registration, register, registry_server
from quantgate.errors import QuantgateError
from quantgate.serving import ServeParams, bind_address, host_problem, url_host
from registry import aliases

PIDS = "server.pid"  # per version folder: the vLLM API server's pid (= its process group id)


def reap_orphans(work_dir: Path, log: Callable[[str], None] = print) -> int:
    """Kill the vLLM process groups recorded in WORK_DIR/v*/server.pid whose leader still runs
    vLLM (an earlier gateway that was killed could not stop them); returns how many."""
    import psutil

    killed = 0
    for pidfile in Path(work_dir).glob(f"v*/{PIDS}"):
        try:
            pid = int(pidfile.read_text())
            alive = "vllm" in " ".join(psutil.Process(pid).cmdline())
        except (ValueError, OSError, psutil.Error):
            alive = False
        if alive:
            log(f"{pidfile.parent.name}: stopping the vLLM server (pid {pid}) an earlier gateway left running")
            os.killpg(pid, signal.SIGKILL)
            killed += 1
        pidfile.unlink(missing_ok=True)
    return killed


OPTIONS = {"fleet": ("--host", "--port"), "fleet.admin": (None, "--admin-port")}  # what `quantgate serve` sets


def check_bindable(host: str, port: int, what: str) -> None:
    """Raises QuantgateError when `host`:`port` cannot be bound now (port 0: the host is checked), naming
    `what`.host (e.g. fleet.host: a name that does not resolve, an address of no interface here) or `what`.port
    (in use, or below 1024 without the right), whichever the failure is about, and where to change it (params.yaml,
    or the serve option that sets it: OPTIONS)."""
    host_option, port_option = OPTIONS.get(what, (None, None))
    if not host.strip():  # bind(("", port)) listens on every interface, and the URL said http://:PORT
        at = f"params.yaml {what}.host" + (f" or {host_option}" if host_option else "")
        raise QuantgateError(f"{what}.host is empty; give an address, e.g. 127.0.0.1, 0.0.0.0 or ::1 ({at})")
    try:
        family, address = bind_address(host, port)
        with socket.socket(family) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as exc:  # socket.gaierror (a name that does not resolve) too
        if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
            at = f"params.yaml {what}.host" + (f" or {host_option}" if host_option else "")
            raise QuantgateError(
                f"{what}.host: {host_problem(host, exc)}; give one, e.g. 127.0.0.1, 0.0.0.0 or ::1 ({at})"
            ) from None
        at = f"params.yaml {what}.port or {port_option}" if port_option else f"params.yaml {what}.port"
        raise QuantgateError(
            f"{what}.port: cannot listen on {url_host(host)}:{port} ({exc.strerror}); free it or pick another ({at})"
        ) from None


def warm_first(fleet: Fleet, params: FleetParams, stop: threading.Event) -> bool:
    """Start planned versions, most important first, until one is warm: one that fails (weights that
    do not verify, a server that does not start) is passed over at once for the next; only when every
    planned version is in its back-off is there a wait, until the first is due (with nothing planned:
    fleet.poll_s). Returns False if `stop` was set first."""
    while not fleet.status():
        fleet.reconcile(max_starts=1)
        if not fleet.status() and not fleet.attempted:
            wait_s = fleet.next_retry_in()
            if stop.wait(params.poll_s if wait_s is None else max(wait_s, 0.05)):
                return False
    return True


class Planner:
    """When the reconcile loop runs next: every `poll_s`, or at once after `wake()` (a registry
    webhook). `stop` ends the wait within `tick_s`."""

    def __init__(self, stop: threading.Event, poll_s: float, tick_s: float = 0.2):
        self.stop, self.poll_s, self.tick_s = stop, poll_s, tick_s
        self._wake = threading.Event()
        self.woken = 0  # passes started by wake()

    def wake(self) -> None:
        """Run the next pass now (thread-safe)."""
        self._wake.set()

    def wait(self) -> bool:
        """Block until the next pass is due; False when `stop` is set."""
        deadline = time.monotonic() + self.poll_s
        while not self.stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            if self._wake.wait(min(left, self.tick_s)):
                self._wake.clear()
                self.woken += 1
                return True
        return False


def webhook_url(params: FleetParams, admin_url: str) -> str:
    """The URL the registry server calls: fleet.webhook_url, else the admin endpoint's /admin/webhook
    (a wildcard admin host, 0.0.0.0 or ::, is called on loopback)."""
    if params.webhook_url:
        return params.webhook_url
    port = admin_url.rsplit(":", 1)[1]
    host = "127.0.0.1" if params.admin.host in ("0.0.0.0", "::", "") else params.admin.host
    return f"http://{url_host(host)}:{port}{WEBHOOK_PATH}"


@dataclass(frozen=True)
class Settings:
    """What `quantgate serve` runs with: params.yaml `evaluate.serve` (every vLLM server), `fleet` (the
    gateway's address, what it keeps warm, its admin endpoint and router) and `limits`."""

    serve: ServeParams
    fleet: FleetParams
    limits: Limits


def run_gateway(
    mlflow_client,
    model_name: str,
    settings: Settings,
    work_dir: Path,
    *,
    log: Callable[[str], None] = print,
    stop: threading.Event | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve `model_name` from the registry until `stop` is set or Ctrl-C (module docstring).

    `settings.fleet.router` gives the router's timeouts and shadow settings, `settings.limits` what one
    request and one team may ask (gateway.limits; prompts counted with the first warm build's tokenizer);
    `on_ready(url)` is called once the gateway listens. Raises QuantgateError if the address
    cannot be bound; every server it started is stopped on every exit path.
    """
    stop, work_dir, params = stop or threading.Event(), Path(work_dir), settings.fleet
    _check_startable(settings, work_dir, mlflow_client, model_name)
    reap_orphans(work_dir, log)
    token = admin_token(work_dir, log)
    started_at = time.time()
    planner = Planner(stop, params.poll_s)
    hooked = params.webhook == "auto" and registry_server(mlflow_client)
    if params.webhook == "auto" and not hooked:
        log(f"serve: the registry is not an `mlflow server` (no webhooks): polling it every {params.poll_s:g} s")
    router: Router | None = None
    webhook: Registration | None = None
    fleet = Fleet(
        mlflow_client,
        model_name,
        settings.serve,
        params,
        work_dir,
        log=log,
        inflight=lambda b: router.inflight(b) if router else 0,
        on_start=lambda version, pid: (work_dir / f"v{version}" / PIDS).write_text(f"{pid}\n"),
    )
    try:
        if not warm_first(fleet, params, stop):
            return
        router = _router(fleet, model_name, settings)
        secret = secrets.token_urlsafe(32)  # new at each start: only this gateway's webhook signs with it
        receiver = Receiver(secret, model_name, _on_alias(planner, router, log)) if hooked else None
        public: dict[str, str] = {"model": model_name}
        admin = _admin_server(router, fleet, public, started_at, token, receiver, params)
        with RouterServer(router, params.host, params.port) as gateway, admin:
            public["url"] = gateway.url
            log(f"serve: {model_name} at {gateway.url}/v1 (OpenAI API), health {gateway.url}/health")
            log(f"serve: admin endpoint at {admin.url}/admin (bearer token; canary run --gateway {admin.url})")
            if receiver is not None:
                webhook = register(mlflow_client, model_name, webhook_url(params, admin.url), secret, log)
            if on_ready:
                on_ready(gateway.url)
            _reconcile_until_stopped(fleet, planner, params, _fleet_gauges(router, fleet), log)
    finally:
        if webhook is not None:
            webhook.close()
        if fleet.close():
            log("serve: every server stopped")


def _router(fleet: Fleet, model_name: str, settings: Settings) -> Router:
    """The router over the fleet's backends, its /health showing the fleet, its limits counting prompts with
    the tokenizer of the first warm build."""
    return Router(
        fleet.resolve,
        settings.fleet.router,
        model_name=model_name,
        health=lambda: {"fleet": fleet.status(), "pid": os.getpid()},
        limits=Limiter(settings.limits, tokenizer_counter(fleet.model_dir())),
    )


def _check_startable(settings: Settings, work_dir: Path, mlflow_client, model_name: str) -> None:
    """Refuse, before a server takes minutes to start: a work dir that cannot be written, an address that
    cannot be bound, one port for both endpoints (or a vLLM server's port that clashes), a limits block whose
    team_keys_file does not read, a model not registered at the client's registry (before any file is written)."""
    params = settings.fleet
    try:
        work_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QuantgateError(f"--work-dir {work_dir}: {exc.strerror}; give a writable folder") from None
    for what, host, port in (
        ("fleet", params.host, params.port),
        ("fleet.admin", params.admin.host, params.admin.port),
    ):
        check_bindable(host, port, what)  # before a server takes minutes to start
    if params.port and params.port == params.admin.port:
        raise QuantgateError(
            f"fleet.port and fleet.admin.port are both {params.port}: the gateway and its admin endpoint need "
            "a port each (--port, --admin-port)"
        )
    try:  # the block's own rules (the vLLM servers' ports too) over --port and --admin-port, set after it was read
        FleetParams.model_validate(params.model_dump())
    except ValidationError as exc:
        first = exc.errors()[0]
        raise QuantgateError(
            f"fleet: {first['msg'].removeprefix('Value error, ')} (params.yaml, --port, --admin-port)"
        ) from None
    Limiter(settings.limits, lambda path, body: 0)  # reads limits.team_keys_file now: its errors before any server
    aliases.current(mlflow_client, model_name)


def _on_alias(planner: Planner, router: Router, log: Callable[[str], None]) -> Callable[[str, str | None], None]:
    """What a registry webhook does: plan and route now."""

    def on_alias(alias: str, version: str | None) -> None:
        planner.wake()
        router.refresh_soon()
        log(f"serve: registry webhook: {alias} -> {'v' + version if version else 'deleted'}; planning now")

    return on_alias


def _admin_server(
    router: Router, fleet: Fleet, public: dict, started_at: float, token: str, receiver, params: FleetParams
) -> AppServer:
    """The admin endpoint (gateway/admin.py) at fleet.admin: its state is `public` (model, url), this process
    (pid, `started_at`) and the fleet's servers with whether each still runs; `receiver` takes the registry's
    webhook, if any."""

    def state() -> dict:
        fleet_now = {v: {**s, "alive": process_alive(s["pid"])} for v, s in fleet.status().items()}
        return {**public, "pid": os.getpid(), "started_at": started_at, "fleet": fleet_now}

    app = admin_app(router, state, token, receiver.endpoint if receiver else None)
    return AppServer(app, params.admin.host, params.admin.port)


def _fleet_gauges(router: Router, fleet: Fleet) -> Callable[[], None]:
    """Gauges of the fleet on the router's /metrics; returns what sets them from the fleet now."""
    servers = Gauge(
        "quantgate_fleet_servers", "Warm vLLM servers by version and why", ["version", "why"], registry=router.registry
    )
    restarts = Gauge(
        "quantgate_fleet_restarts", "Restarts of a version's server", ["version"], registry=router.registry
    )

    def update() -> None:
        servers.clear()
        for version, s in fleet.status().items():
            servers.labels(version, s["why"]).set(1)
            restarts.labels(version).set(s["restarts"])

    return update


def _reconcile_until_stopped(
    fleet: Fleet, planner: Planner, params: FleetParams, gauges: Callable[[], None], log: Callable[[str], None]
) -> None:
    """Reconcile the fleet at each pass the planner calls for, until stopped; a pass that fails (the
    registry unreachable for a while) keeps serving what is warm."""
    while planner.wait():
        try:
            fleet.reconcile()
        except Exception as exc:
            log(f"serve: reconcile failed, keeping the warm servers: {type(exc).__name__}: {exc}")
            time.sleep(params.restart_backoff_s)
        gauges()
