"""A gateway in this process, for a canary run without a standing `quantgate serve`.

The canary controller drives every gateway the same way: through its admin endpoint (gateway/admin.py). Without a
standing gateway it starts this one around its own router: the public OpenAI endpoint at the address asked for,
and the admin endpoint on loopback, on a free port, with a bearer token made for this run (nothing else learns it).

    with local_gateway(router, servers.status, "127.0.0.1", 0) as gw:
        RemoteRouter(gw.admin_url, gw.token).set_weight(5)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from gateway.admin import admin_app
from gateway.router import Router
from gateway.server import AppServer, RouterServer

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class LocalGateway:
    """Where an in-process gateway listens: `url` its public endpoint, `admin_url` and `token` its admin endpoint."""

    url: str
    admin_url: str
    token: str


@contextlib.contextmanager
def local_gateway(router: Router, servers: Callable[[], dict], host: str, port: int) -> Iterator[LocalGateway]:
    """Serve `router` at host:port (0: a free port) and its admin endpoint on loopback until the block ends.

    `servers()` gives the admin state's fleet: {version: {"url", "pid", "alive", ...}}, as `quantgate serve`
    reports its servers. Raises QuantgateError if an address cannot be bound or the router's first resolve()
    fails (gateway.server).
    """
    token, started_at, public = secrets.token_urlsafe(32), time.time(), {"model": router.model_name}

    def state() -> dict:
        return {**public, "pid": os.getpid(), "started_at": started_at, "fleet": servers()}

    with RouterServer(router, host, port) as gateway, AppServer(admin_app(router, state, token), LOOPBACK) as admin:
        public["url"] = gateway.url
        yield LocalGateway(gateway.url, admin.url, token)
