"""The vLLM servers of a canary run without a standing gateway, one per registry version, and the
router's resolver.

Each server is started from the version's registered artifacts after they are downloaded and
verified against the version's weight digests (gateway.fleet.open_server), or reused from a URL the
operator gives (gateway.fleet.reused_backend: then only its /v1/models is checked). Servers it
started are stopped on close, on every exit path.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from canary.policy import Servers
from gateway.fleet import Registered, open_server, serve_params
from gateway.router import Backend
from quantgate.serving import ServeParams, Server
from registry import aliases


class LocalServers:
    """Servers by version ("3" -> Backend); use as a context manager."""

    def __init__(self, mlflow_client, model_name: str, serve: ServeParams, servers: Servers, work_dir: Path):
        self.client, self.model, self.serve, self.servers = mlflow_client, model_name, serve, servers
        self.work_dir = Path(work_dir)
        self.backends: dict[str, Backend] = {}
        self.started: dict[str, Server] = {}  # the servers this fleet started
        self.pids: dict[str, int] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "LocalServers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop every server this fleet started (waits for their process groups), then delete
        the downloaded artifacts (server logs stay)."""
        try:
            self._stack.close()
        finally:
            for d in self.work_dir.glob("v*/artifacts"):
                shutil.rmtree(d, ignore_errors=True)

    def start(self, version: str, role: str, log=print) -> Backend:
        """Verify `version`'s artifacts and serve them with the `role` server settings
        (canary_topology.servers.<role>); returns its Backend. Reuses a server already in the fleet.

        Raises QuantgateError if the weights do not verify or the server does not start.
        """
        if version in self.backends:
            return self.backends[version]
        override = getattr(self.servers, role)
        backend, server, _ = open_server(
            self._stack,
            Registered(self.client, self.model, self.work_dir),
            version,
            serve_params(self.serve, override),
            role,
            lambda line: log(f"canary: {line}"),
        )
        self.started[version], self.pids[version], self.backends[version] = server, server.pid, backend
        return backend

    def reuse(self, version: str, backend: Backend) -> Backend:
        """Use a running server (`reused_backend`'s) for `version` instead of starting one."""
        self.backends[version] = backend
        return backend

    def alive(self, version: str) -> bool:
        """False when a server this fleet started for `version` has exited (reused ones: True)."""
        server = self.started.get(version)
        return server is None or not server.exited()

    def status(self) -> dict[str, dict]:
        """{version: {"url", "pid" (None for a reused server), "alive"}}: the fleet part of the admin state that
        an in-process gateway (gateway/inprocess.py) reports, as `quantgate serve` reports its servers."""
        return {v: {"url": b.url, "pid": self.pids.get(v), "alive": self.alive(v)} for v, b in self.backends.items()}

    def death(self, version: str) -> str | None:
        """Why the server this fleet started for `version` died, in one line (quantgate.serving.Server.death:
        seconds after it was ready, exit code or signal, its log's last error line); None while it runs
        and for reused servers."""
        server = self.started.get(version)
        return None if server is None else server.death()

    def resolver(self, stable_default: str) -> Callable[[], Mapping[str, Backend | None]]:
        """resolve() for the router: backends from the registry aliases at each call.

        stable = production (else fallback), candidate = `candidate`, shadow = `fallback`, each
        only when this fleet serves that version; stable falls back to `stable_default`'s server,
        so an alias flip to a version with a server moves traffic, and a flip to one without
        never leaves the router without a backend.
        """

        def resolve() -> dict[str, Backend | None]:
            now = aliases.current(self.client, self.model)
            served = self.backends.get
            stable = served(now.get(aliases.PRODUCTION) or now.get(aliases.FALLBACK) or "") or served(stable_default)
            return {
                "stable": stable,
                "candidate": served(now.get(aliases.CANDIDATE) or ""),
                "shadow": served(now.get(aliases.FALLBACK) or ""),
            }

        return resolve
