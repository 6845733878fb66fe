"""Serve an ASGI app (the gateway's router, its admin endpoint, test backends) with uvicorn in a background thread.

    with AppServer(app, "127.0.0.1", 0) as srv:   # port 0 = a free port, bound before start
        httpx.get(f"{srv.url}/health")

The socket is bound here (not by uvicorn) so the port is known before the first request and
nothing else can take it in between. `stop()` lets open requests finish for up to
`grace_s` seconds, then cancels them.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from quantgate.errors import QuantgateError
from quantgate.serving import bind_address, url_host


class AppServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, grace_s: float = 5.0):
        self.app, self.host, self.port, self.grace_s = app, host, port, grace_s
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """http://host:port (no trailing slash)."""
        return f"http://{url_host(self.host)}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> AppServer:
        """Bind (IPv4, or IPv6 for an IPv6 address or a name only IPv6 knows: bind_address), start serving and
        return once the app's startup has finished.

        Raises QuantgateError if the host does not resolve, the port cannot be bound or the app fails to start in
        time.
        """
        try:
            family, address = bind_address(self.host, self.port)
        except OSError as exc:  # socket.gaierror
            raise QuantgateError(f"cannot listen on {self.host}:{self.port}: {exc.strerror}") from None
        # proto IPPROTO_TCP (not 0) so asyncio sets TCP_NODELAY on accepted connections;
        # without it Nagle + delayed ACK add ~40 ms to every response
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            sock.close()
            raise QuantgateError(f"cannot listen on {self.host}:{self.port}: {exc.strerror}") from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=self.grace_s
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._serve, args=(self._server, sock), name=f"uvicorn-{self.port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise QuantgateError(f"server on {self.url} did not start: {self.startup_error()}")
            time.sleep(0.01)
        return self

    @staticmethod
    def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
        try:
            server.run(sockets=[sock])
        except SystemExit:  # uvicorn exits on a failed startup; start() reports it
            pass
        finally:
            sock.close()

    def startup_error(self) -> str:
        """Why startup failed, for the error message (subclasses know more)."""
        return "see the log above"

    def stop(self) -> None:
        """Stop serving and wait for the thread; safe to call twice."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=self.grace_s + 5)
        self._server = self._thread = None

    def __enter__(self) -> AppServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RouterServer(AppServer):
    """A gateway.router.Router served in a background thread: `RouterServer(router, host, port).start()`.

    start() raises QuantgateError if the first resolve() fails (the router never routes blind).
    """

    def __init__(self, router, host: str = "127.0.0.1", port: int = 0, grace_s: float = 5.0):
        super().__init__(router.app, host, port, grace_s)
        self.router = router

    def startup_error(self) -> str:
        if self.router.resolve_error:
            return f"resolve() failed: {self.router.resolve_error}"
        return super().startup_error()
