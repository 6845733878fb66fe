"""The standing fleet: the vLLM servers that follow the registry aliases (`quantgate serve`).

Which versions are kept warm is a plan recomputed from the aliases on every pass
(`plan()`): the serving build (`production`, else `fallback`) first, then `fallback`,
`candidate` (a canary's build) and `previous` (an instant rollback target, when
`keep_previous`), each version once, at most `max_servers` in all. `StandingFleet.reconcile()`
makes the running servers match it:
- a planned version without a server is verified against its registered weight digests
  (registry/verify.py) and started (canary.fleet.open_server); a start that fails is retried
  after `restart_backoff_s`;
- a server whose process died is dropped from routing at once, then started again (counted in
  `restarts`);
- a server no longer planned leaves routing first, is drained (its in-flight requests, as the
  router counts them, finish, for up to `drain_s`), then stopped.
`resolve()` is the router's view (canary.router.Fleet roles), read from the aliases at each
call, so an alias flip to a warm version moves traffic within the router's resolve interval;
a flip to a cold one moves it once its server is up; until then `previous` (the build that
served before a promotion), else `fallback`, else any warm server answers.
Aliases that point at the same version share one server.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field, model_validator

from canary.fleet import open_server, process_alive
from canary.policy import ServerOverride, serve_params
from canary.router import Backend
from quantgate.errors import QuantgateError
from quantgate.params import PARAMS_FILE, Frozen, load_block
from quantgate.serving import ServeParams
from registry import aliases

SERVING = "serving"  # the plan's name for the version that takes production traffic


class FleetServers(Frozen):
    """Per-server changes to `evaluate.serve`: the serving build's server, and every warm one
    (their cpu_cores give way to FleetParams.cpu_core_sets when that is set)."""

    serving: ServerOverride = ServerOverride()
    warm: ServerOverride = ServerOverride()


class AdminAddress(Frozen):
    """The gateway's admin endpoint (canary/admin.py): loopback by default; elsewhere is the operator's choice."""

    host: str = "127.0.0.1"
    port: int = Field(default=8001, ge=0, le=65535)  # 0 = a free port


class FleetParams(Frozen):
    """params.yaml block `fleet`: the gateway's address and what the standing fleet keeps warm."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0 = a free port
    max_servers: int = Field(default=3, ge=1)  # vLLM servers at once, the serving build's included
    keep_previous: bool = True  # keep `previous` warm (a rollback then needs no cold start)
    poll_s: float = Field(default=0.5, gt=0)  # seconds between reconcile passes (registry reads)
    drain_s: float = Field(default=30, ge=0)  # seconds a replaced server may finish in-flight requests
    restart_backoff_s: float = Field(default=5, ge=0)  # after a failed start, before the next try
    # vLLM CPU: core sets (VLLM_CPU_OMP_THREADS_BIND) handed out to servers, each new server taking
    # the set fewest running servers use; [] = vLLM's own binding (every server on the same cores)
    cpu_core_sets: list[str] = ["0", "1"]
    servers: FleetServers = FleetServers()
    admin: AdminAddress = AdminAddress()

    @model_validator(mode="after")
    def _own_port(self) -> FleetParams:  # an after-validator: it also sees a default admin port
        if self.admin.port and self.admin.port == self.port:
            raise ValueError(f"admin.port {self.port} is also fleet.port; give the admin endpoint its own port")
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


@dataclass
class Running:
    """One started vLLM server; closing `stack` stops it."""

    backend: Backend
    pid: int
    why: str
    stack: contextlib.ExitStack
    model_dir: Path  # the verified weights it serves
    cores: str | None  # VLLM_CPU_OMP_THREADS_BIND it was started with
    started_at: float = field(default_factory=time.time)
    restarts: int = 0


class StandingFleet:
    """The servers of `quantgate serve`; see the module docstring. Thread-safe: `reconcile` runs in
    the fleet's own thread, `resolve` and `status` in the router's."""

    def __init__(
        self,
        mlflow_client,
        model_name: str,
        serve: ServeParams,
        params: FleetParams,
        work_dir: Path,
        log: Callable[[str], None] = print,
        inflight: Callable[[Backend], int] = lambda b: 0,
        on_start: Callable[[str, int], None] = lambda version, pid: None,
    ):
        self.client, self.model, self.serve, self.params = mlflow_client, model_name, serve, params
        self.work_dir, self.log, self.inflight, self.on_start = Path(work_dir), log, inflight, on_start
        self.failures: dict[str, tuple[float, str]] = {}  # version -> (when, why) of the last failed start
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
        for version in [v for v, r in list(self._servers.items()) if not process_alive(r.pid)]:
            self.log(f"v{version}: vLLM server (pid {self._servers[version].pid}) exited; starting it again")
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
            failed = self.failures.get(version)
            if failed and time.time() - failed[0] < self.params.restart_backoff_s:
                continue
            if max_starts is not None and starts >= max_starts:
                break
            starts += 1
            self._start(version, why)
        self.attempted = starts
        return wanted

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
        stack = contextlib.ExitStack()
        try:
            backend, pid, model_dir = open_server(
                stack,
                self.client,
                self.model,
                version,
                serve_params(self.serve, override),
                self.work_dir,
                why,
                self.log,
            )
        except QuantgateError as exc:
            stack.close()
            self.failures[version] = (time.time(), str(exc))
            self.log(f"v{version}: not served: {exc}")
            return
        self.failures.pop(version, None)
        self.on_start(version, pid)
        with self._lock:
            self._servers[version] = Running(
                backend, pid, why, stack, model_dir, override.cpu_cores, restarts=self._restarts.get(version, 0)
            )

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
