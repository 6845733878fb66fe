"""The standing fleet: the vLLM servers that follow the registry aliases (`quantgate serve`).

Which versions are kept warm is a plan recomputed from the aliases on every pass
(`plan()`): the serving build (`production`, else `fallback`) first, then `fallback`,
`candidate` (a canary's build) and `previous` (an instant rollback target, when
`keep_previous`), each version once, at most `max_servers` in all. `Fleet.reconcile()`
makes the running servers match it:
- a planned version without a server is verified against its registered weight digests
  (registry/verify.py) and started (`open_server`, below). A verification is kept per
  (version, registered weights_sha256), so a later start of the same weights (a server that died,
  a start that failed) does not download and hash the whole model again. A start that fails is
  tried again after `restart_backoff_s`, doubling after each failure up to `restart_backoff_max_s`;
  the log has one line when a version starts failing, when the reason changes, and when it serves;
- a server whose process died is dropped from routing at once, then started again (counted in
  `restarts`);
- a server no longer planned leaves routing first, is drained (its in-flight requests, as the
  router counts them, finish, for up to `drain_s`), then stopped.
`resolve()` is the router's view (gateway.router.Backends roles), read from the aliases at each
call, so an alias flip to a warm version moves traffic within the router's resolve interval;
a flip to a cold one moves it once its server is up; until then `previous` (the build that
served before a promotion), else `fallback`, else any warm server answers.
Aliases that point at the same version share one server.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx
from pydantic import Field, field_validator, model_validator

from gateway.router import Backend, RouterParams
from gateway.webhook import PATH
from quantgate.errors import QuantgateError
from quantgate.params import PARAMS_FILE, Frozen, load_block
from quantgate.serving import ServeParams, Server, check_cpu_cores, check_extra_args, vllm_server
from registry import aliases, tags, versions
from registry.verify import verify_version

SERVING = "serving"  # the plan's name for the version that takes production traffic


class ServerOverride(Frozen):
    """Per-role changes to `evaluate.serve` for a canary vLLM server."""

    port: int = Field(default=0, ge=0, le=65535)  # 0 = a free port
    cpu_cores: str | None = None  # vLLM CPU: cores for this server's worker (VLLM_CPU_OMP_THREADS_BIND)
    extra_args: list[str] = []  # appended to evaluate.serve.extra_args

    _one_precision = field_validator("extra_args")(classmethod(lambda cls, args: check_extra_args(args)))
    _cores = field_validator("cpu_cores")(classmethod(lambda cls, value: check_cpu_cores(value)))


def check_host(value: str) -> str:
    """`value`, an address to listen on; raises ValueError when it is empty or blank (every interface, which is
    0.0.0.0 written out, and a URL of http://:PORT)."""
    if not value.strip():
        raise ValueError("must not be empty or blank: give an address, e.g. 127.0.0.1, 0.0.0.0 or ::1")
    return value


def serve_params(base: ServeParams, override: ServerOverride) -> ServeParams:
    """`evaluate.serve` with a role's port, CPU cores and extra vLLM args (appended) applied."""
    data = base.model_dump()
    data.update(port=override.port, extra_args=[*base.extra_args, *override.extra_args])
    if override.cpu_cores:
        data["cpu_cores"] = override.cpu_cores
    return ServeParams.model_validate(data)


class FleetServers(Frozen):
    """Per-server changes to `evaluate.serve`: the serving build's server, and every warm one
    (their cpu_cores give way to FleetParams.cpu_core_sets when that is set)."""

    serving: ServerOverride = ServerOverride()
    warm: ServerOverride = ServerOverride()


class AdminAddress(Frozen):
    """The gateway's admin endpoint (gateway/admin.py): loopback by default; elsewhere is the operator's choice."""

    host: str = "127.0.0.1"
    port: int = Field(default=8001, ge=0, le=65535)  # 0 = a free port

    _host = field_validator("host")(classmethod(lambda cls, value: check_host(value)))


class FleetParams(Frozen):
    """params.yaml block `fleet`: the gateway's address and what the standing fleet keeps warm."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0 = a free port
    max_servers: int = Field(default=3, ge=1)  # vLLM servers at once, the serving build's included
    keep_previous: bool = True  # keep `previous` warm (a rollback then needs no cold start)
    poll_s: float = Field(default=0.5, gt=0)  # seconds between reconcile passes (registry reads)
    drain_s: float = Field(default=30, ge=0)  # seconds a replaced server may finish in-flight requests
    restart_backoff_s: float = Field(default=5, ge=0)  # after a failed start, before the next try
    restart_backoff_max_s: float = Field(default=300, ge=0)  # the back-off doubles per failure up to this
    # MLflow registry webhooks (gateway/webhook.py): auto = register one when the registry is an
    # `mlflow server` (http(s) URI), so alias changes wake the planner at once; off = poll only
    webhook: Literal["auto", "off"] = "auto"
    webhook_url: str | None = None  # what the registry server calls; None = http://<admin host:port>/admin/webhook
    # vLLM CPU: core sets (VLLM_CPU_OMP_THREADS_BIND) handed out to servers, each new server taking
    # the set fewest running servers use; [] = vLLM's own binding (every server on the same cores)
    cpu_core_sets: list[str] = ["0", "1"]
    servers: FleetServers = FleetServers()
    admin: AdminAddress = AdminAddress()
    router: RouterParams = RouterParams()  # what the router does with each request: timeouts, shadowing

    _host = field_validator("host")(classmethod(lambda cls, value: check_host(value)))

    @field_validator("cpu_core_sets")
    @classmethod
    def _core_lists(cls, v: list[str]) -> list[str]:
        return [check_cpu_cores(cores) for cores in v]

    @field_validator("webhook_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", v):
            example = f"http://gw:8001{PATH}"
            raise ValueError(f"must be an http(s) URL the registry server reaches, e.g. {example}; got {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> FleetParams:  # an after-validator: it also sees a default admin port
        if self.admin.port and self.admin.port == self.port:
            raise ValueError(f"admin.port {self.port} is also fleet.port; give the admin endpoint its own port")
        # vLLM servers' ports: a clash would show only once a server has taken minutes to start
        taken = {"fleet.port": self.port, "admin.port": self.admin.port}
        for role in ("serving", "warm"):
            port = getattr(self.servers, role).port
            if port and (other := next((name for name, p in taken.items() if p == port), None)):
                raise ValueError(
                    f"servers.{role}.port {port} is also {other}; give each its own port, or 0 for a free one"
                )
            taken[f"servers.{role}.port"] = port
        if self.servers.warm.port and self.max_servers > 2:
            raise ValueError(
                f"servers.warm.port {self.servers.warm.port}: up to {self.max_servers - 1} warm servers run at once "
                f"(max_servers {self.max_servers}) and one port serves one; set it to 0 (a free port each), or "
                "max_servers to 2"
            )
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ValueError(
                f"restart_backoff_max_s {self.restart_backoff_max_s:g} is below restart_backoff_s "
                f"{self.restart_backoff_s:g}; the cap must be at least the first back-off"
            )
        return self


def load_fleet_params(path: Path = PARAMS_FILE) -> FleetParams:
    """Block `fleet` of params.yaml. Raises QuantgateError naming params.yaml:<line>: fleet.<field>."""
    return load_block("fleet", FleetParams, path)


def plan(now: dict[str, str], params: FleetParams) -> list[tuple[str, str]]:
    """[(version, why)] to keep warm, most important first, each version once, at most
    params.max_servers: the serving build (why "serving": production, else fallback), then
    fallback, candidate and (keep_previous) previous. `now` is {alias: version}."""
    wanted = [
        (now.get(aliases.PRODUCTION) or now.get(aliases.FALLBACK), SERVING),
        (now.get(aliases.FALLBACK), aliases.FALLBACK),
        (now.get(aliases.CANDIDATE), aliases.CANDIDATE),
        (now.get(aliases.PREVIOUS) if params.keep_previous else None, aliases.PREVIOUS),
    ]
    out: list[tuple[str, str]] = []
    for version, why in wanted:
        if version is not None and version not in {v for v, _ in out}:
            out.append((version, why))
    return out[: params.max_servers]


def _kind(why: str) -> str:
    """A failure's reason without its numbers: a server log's timestamps, pids and ports differ per try."""
    return re.sub(r"\d+", "#", why)


@dataclass
class Failing:
    """A planned version that could not be served: failed tries in a row, the last reason, and
    when (the fleet's clock, s) the next try is due."""

    tries: int
    why: str
    next_try: float


@dataclass
class Running:
    """One started vLLM server; closing `stack` stops it."""

    backend: Backend
    server: Server
    why: str
    stack: contextlib.ExitStack
    model_dir: Path  # the verified weights it serves
    cores: str | None  # VLLM_CPU_OMP_THREADS_BIND it was started with
    started_at: float = field(default_factory=time.time)
    restarts: int = 0

    @property
    def pid(self) -> int:
        """The API server's pid (leader of its process group)."""
        return self.server.pid


@dataclass(eq=False)
class Fleet:
    """The servers of `quantgate serve`; see the module docstring. Thread-safe: `reconcile` runs in
    the fleet's own thread, `resolve` and `status` in the router's. `inflight` says how many requests a
    backend has open (the router's count, for draining), `on_start(version, pid)` is called for each
    server started, `clock` gives the back-off's seconds."""

    client: object  # MlflowClient
    model: str
    serve: ServeParams
    params: FleetParams
    work_dir: Path
    log: Callable[[str], None] = print
    inflight: Callable[[Backend], int] = lambda b: 0
    on_start: Callable[[str, int], None] = lambda version, pid: None
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.work_dir = Path(self.work_dir)
        self.failures: dict[str, Failing] = {}  # versions whose last start failed
        self._verified: dict[str, tuple[str | None, Path]] = {}  # version -> (weights_sha256, verified dir)
        self._servers: dict[str, Running] = {}
        self._restarts: dict[str, int] = {}
        self._lock = threading.Lock()
        self.attempted = 0  # starts tried by the last reconcile pass

    # --- the router's view ---------------------------------------------------------
    def resolve(self) -> dict[str, Backend | None]:
        """The router's backends from the aliases now: stable = production's server, else (while
        a new production starts) previous's, else fallback's, else any warm one; candidate =
        `candidate`'s; shadow = `fallback`'s (the router's last retry). Raises QuantgateError
        when no server is warm."""
        now = aliases.current(self.client, self.model)
        with self._lock:
            served = {v: r.backend for v, r in self._servers.items()}
        chain = (now.get(aliases.PRODUCTION), now.get(aliases.PREVIOUS), now.get(aliases.FALLBACK))
        warm = [served[v] for v in chain if v in served]
        stable = warm[0] if warm else next(iter(served.values()), None)
        if stable is None:
            raise QuantgateError(f"{self.model}: no vLLM server is warm yet")
        return {
            "stable": stable,
            "candidate": served.get(now.get(aliases.CANDIDATE) or ""),
            "shadow": served.get(now.get(aliases.FALLBACK) or ""),
        }

    def status(self) -> dict[str, dict]:
        """{version: {url, pid, why, cores, restarts, up_s}} of the warm servers."""
        with self._lock:
            return {
                v: {
                    "url": r.backend.url,
                    "pid": r.pid,
                    "why": r.why,
                    "cores": r.cores,
                    "restarts": r.restarts,
                    "up_s": round(time.time() - r.started_at, 1),
                }
                for v, r in self._servers.items()
            }

    def model_dir(self) -> Path | None:
        """The verified weights of one warm server (every build shares the tokenizer), None if none is warm."""
        with self._lock:
            return next((r.model_dir for r in self._servers.values()), None)

    # --- making the servers match the plan -----------------------------------------
    def reconcile(self, max_starts: int | None = None) -> list[tuple[str, str]]:
        """One pass (see the module docstring), starting at most `max_starts` servers (None = all
        planned); returns the plan it worked to. Starting a server blocks this thread (about 35 s
        on a CPU), never the router."""
        wanted = plan(aliases.current(self.client, self.model), self.params)
        keep = {v for v, _ in wanted}
        for version in [v for v, r in list(self._servers.items()) if r.server.exited()]:
            server = self._servers[version].server
            self.log(f"v{version}: {server.death() or f'vLLM server (pid {server.pid}) exited'}; starting it again")
            self._restarts[version] = self._restarts.get(version, 0) + 1
            self._stop(version, drain=False)
        for version in [v for v in self._servers if v not in keep]:
            self.log(f"v{version}: no longer planned; draining, then stopping its server")
            self._stop(version, drain=True)
        starts = 0
        for version, why in wanted:
            with self._lock:
                if version in self._servers:
                    self._servers[version].why = why
                    continue
            failing = self.failures.get(version)
            if failing and self.clock() < failing.next_try:
                continue
            if max_starts is not None and starts >= max_starts:
                break
            starts += 1
            self._start(version, why)
        self.attempted = starts
        return wanted

    def next_retry_in(self) -> float | None:
        """Seconds until the next retry of a version whose start failed is due (0: now), None if none failed."""
        if not self.failures:
            return None
        return max(0.0, min(f.next_try for f in self.failures.values()) - self.clock())

    def cores_for_next(self) -> str | None:
        """The cpu_core_sets entry fewest running servers use (ties: the first), None without sets.
        Two servers bound to one core starve each other: a server starting beside a busy one
        on the same core took minutes instead of ~35 s here."""
        sets = self.params.cpu_core_sets
        if not sets:
            return None
        with self._lock:
            used = [r.cores for r in self._servers.values()]
        return min(sets, key=lambda c: (used.count(c), sets.index(c)))

    def _start(self, version: str, why: str) -> None:
        override = self.params.servers.serving if why == SERVING else self.params.servers.warm
        if (cores := self.cores_for_next()) is not None:
            override = override.model_copy(update={"cpu_cores": cores})
        failing = self.failures.get(version)
        log = self.log if failing is None else (lambda line: None)  # a retry logs only a change of state
        stack = contextlib.ExitStack()
        try:
            backend, server, model_dir = open_server(
                stack,
                Registered(self.client, self.model, self.work_dir),
                version,
                serve_params(self.serve, override),
                why,
                log,
                verified=self._verified_weights(version, log),
            )
        except QuantgateError as exc:
            stack.close()
            self._failed(version, str(exc))
            return
        if failing is not None:
            self.log(f"v{version}: serving after {failing.tries} failed start(s)")
        self.failures.pop(version, None)
        self.on_start(version, server.pid)
        with self._lock:
            self._servers[version] = Running(
                backend, server, why, stack, model_dir, override.cpu_cores, restarts=self._restarts.get(version, 0)
            )

    def _verified_weights(self, version: str, log: Callable[[str], None]) -> Path:
        """`version`'s weights, downloaded to WORK_DIR/v<version>/artifacts and checked against its
        registered digests (registry/verify.py) once per (version, weights_sha256 tag): a later call
        while the tag is the same returns the same folder without hashing it again. Raises
        QuantgateError when they do not verify (nothing is kept then)."""
        digest = versions.require_version(self.client, self.model, version).tags.get(tags.WEIGHTS)
        known = self._verified.get(version)
        if known is not None and known[0] == digest and known[1].is_dir():
            return known[1]
        self._verified.pop(version, None)
        dest = self.work_dir / f"v{version}" / "artifacts"
        shutil.rmtree(dest, ignore_errors=True)
        model_dir = verify_version(self.client, self.model, version, dest)
        log(f"v{version}: weights verified against the registry (weights_sha256 {str(digest)[:12]}...)")
        self._verified[version] = (digest, model_dir)
        return model_dir

    def _failed(self, version: str, why: str) -> None:
        """Record a failed start: the next try after restart_backoff_s x 2^(tries - 1), at most
        restart_backoff_max_s; one log line when the version starts failing or the reason changes."""
        before = self.failures.get(version)
        tries = before.tries + 1 if before else 1
        p = self.params
        delay = min(p.restart_backoff_s * 2 ** min(tries - 1, 32), p.restart_backoff_max_s)
        self.failures[version] = Failing(tries, why, self.clock() + delay)
        if before is None:
            self.log(
                f"v{version}: not served: {why}; next try in {delay:g} s, "
                f"then after twice as long each time, up to {p.restart_backoff_max_s:g} s"
            )
        elif _kind(why) != _kind(before.why):
            self.log(f"v{version}: still not served after {tries} tries, now: {why}; next try in {delay:g} s")

    def _stop(self, version: str, drain: bool) -> None:
        with self._lock:
            running = self._servers.pop(version)  # out of resolve() first: no new requests
        if drain:
            deadline = time.monotonic() + self.params.drain_s
            while self.inflight(running.backend) > 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            if (left := self.inflight(running.backend)) > 0:
                self.log(f"v{version}: {left} requests still in flight after drain_s={self.params.drain_s:g} s")
        running.stack.close()
        self.log(f"v{version}: server stopped")

    def close(self) -> int:
        """Stop every server (no drain: the gateway has stopped taking requests); returns how many."""
        versions = list(self._servers)
        for version in versions:
            self._stop(version, drain=False)
        return len(versions)


def reused_backend(version: str, url: str) -> Backend:
    """The running OpenAI server at `url` (…/v1) as `version`'s backend (`--reuse VERSION=URL`; not verified);
    raises QuantgateError if it does not answer /models with a model."""
    url = url.rstrip("/")
    try:
        r = httpx.get(f"{url}/models", timeout=10)
        r.raise_for_status()
        name = r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise QuantgateError(f"--reuse v{version}={url}: no OpenAI server answers /models there ({exc})") from None
    return Backend(url=url, model=name, label=f"v{version}")


@dataclass(frozen=True)
class Registered:
    """Where a version's server comes from: the registry `client`, the registered `model`, and the `work_dir`
    whose v<version>/ folder holds the version's downloaded artifacts, its server log and pid."""

    client: object  # MlflowClient
    model: str
    work_dir: Path


def open_server(
    stack: contextlib.ExitStack,
    source: Registered,
    version: str,
    params: ServeParams,
    role: str,
    log=print,
    verified: Path | None = None,
) -> tuple[Backend, Server, Path]:
    """Verify `version`'s registered artifacts (downloaded to WORK_DIR/v<version>/artifacts) and
    start its vLLM server with `params` on `stack` (closing the stack stops it); returns its
    (Backend labelled "v<version>", served as "<model>-v<version>", the Server (its pid, its death),
    model dir).
    `source`: the registry, the model and the work folder. `verified`: the version's weights as the caller
    already verified them (Fleet keeps them per digest): served from there, not downloaded again.

    Raises QuantgateError if the weights do not verify or the server does not start.
    """
    mlflow_client, model_name = source.client, source.model
    vdir = Path(source.work_dir) / f"v{version}"
    if verified is None:
        shutil.rmtree(vdir / "artifacts", ignore_errors=True)  # a restart downloads and verifies again
        model_dir = verify_version(mlflow_client, model_name, version, vdir / "artifacts")
        log(f"v{version} weights verified against the registry; starting its vLLM server ({role})")
    else:
        model_dir = verified
        log(f"v{version}: starting its vLLM server ({role})")
    name = f"{model_name}-v{version}"
    server = stack.enter_context(vllm_server(params, model_dir, name, vdir / "server.log"))
    log(f"v{version} serving at {server.base_url}")
    return Backend(url=server.base_url, model=name, label=f"v{version}"), server, model_dir


def process_alive(pid: int) -> bool:
    """False when process `pid` has exited (a dead child stays a zombie until its Popen reaps it)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
