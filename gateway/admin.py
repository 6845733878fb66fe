"""The gateway's admin endpoint, and the client a canary controller in another process drives it with.

`quantgate serve` serves `admin_app(...)` on its own AppServer at params.yaml `fleet.admin`
(127.0.0.1:8001 by default: loopback only; binding it elsewhere is the operator's choice, and
then the token is all that guards the split). Every request needs `Authorization: Bearer
<token>` (hmac.compare_digest); else 401. The token: env QUANTGATE_ADMIN_TOKEN, else one
generated at start and written to WORK_DIR/admin.token (mode 0600; `admin_token`).

    GET /admin/state                 {url, pid, started_at, weight, shadow_fraction, shadow_teams, stable,
                                      candidate, shadow, fleet: {version: {url, pid, why, ..., alive}}}
    PUT /admin/weight {"percent": p} set the candidate's share (0-100; else 400)
    GET /admin/samples?since=EPOCH_S {samples: [Sample...], shadows: [ShadowSample...]} (gateway.metrics)
    POST /admin/webhook              MLflow registry webhook deliveries (gateway/webhook.py): signed
                                     with the webhook's HMAC secret instead of the bearer token

`RemoteRouter` is that API as the controller's split (set_weight, samples_since, shadows_since,
alive), so canary/controller.py walks the same steps with the same analysis against a running
gateway as against its own Router.
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.metrics import Sample, ShadowSample
from gateway.webhook import PATH as WEBHOOK_PATH
from quantgate.errors import QuantgateError
from quantgate.files import not_to_open

TOKEN_ENV = "QUANTGATE_ADMIN_TOKEN"
TOKEN_FILE = "admin.token"  # in the gateway's work dir


MIN_TOKEN = 16  # characters of $QUANTGATE_ADMIN_TOKEN: 16 random url-safe ones are 96 bits


def token_problem(token: str) -> str | None:
    """Why `token` cannot travel in an `Authorization: Bearer` header, or None: a non-ASCII character (an HTTP
    header carries ASCII only: httpx refused it with a UnicodeEncodeError) or a control character (a newline
    would end the header)."""
    for c in token:
        if not c.isascii():
            return f"has a non-ASCII character ({c!r}), which an HTTP header cannot carry"
        if not c.isprintable():
            return f"has a control character ({c!r})"
    return None


def admin_token(work_dir: Path, log: Callable[[str], None] = print) -> str:
    """$QUANTGATE_ADMIN_TOKEN, else a new random token written to WORK_DIR/admin.token (0600).
    Raises QuantgateError for a set but blank or short (< MIN_TOKEN characters) $QUANTGATE_ADMIN_TOKEN:
    the token is all that guards the split when the endpoint is reachable from elsewhere; and for one no
    client could send (`token_problem`)."""
    if (given := os.environ.get(TOKEN_ENV)) is not None:
        example = "e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`, or unset it for a generated one"
        token = given.strip()
        if token and (problem := token_problem(token)) is not None:
            raise QuantgateError(f"${TOKEN_ENV} {problem}; give printable ASCII, {example}")
        if len(token) < MIN_TOKEN:
            raise QuantgateError(
                f"${TOKEN_ENV} is {'blank' if not token else f'{len(token)} characters'}; give at least {MIN_TOKEN}, "
                + example
            )
        log(f"serve: admin token from ${TOKEN_ENV}")
        return token
    token = secrets.token_urlsafe(32)
    path = Path(work_dir) / TOKEN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # an older file keeps its mode through O_CREAT
        f.write(token + "\n")
    log(f"serve: admin token written to {path} (mode 0600)")
    return token


class EmptyTokenFile(QuantgateError):
    """read_token's refusal of a --token-file given empty ('': an unset shell variable) that it had to read:
    a usage error for the command that took it (click's, exit 2, naming the option)."""


def read_token(token_file: Path | None) -> str:
    """$QUANTGATE_ADMIN_TOKEN, else (unset or blank) the token in `token_file`, which only then is looked at: a
    broken symlink, a FIFO, socket or device is refused unread (reading a FIFO nobody writes waits forever); None
    (--token-file given empty) is refused then too, as EmptyTokenFile. Raises QuantgateError naming where the
    token came from when neither gives one, or when it cannot be sent (`token_problem`)."""
    given = os.environ.get(TOKEN_ENV)
    if given is not None and (token := given.strip()):
        if (problem := token_problem(token)) is not None:
            raise QuantgateError(
                f"${TOKEN_ENV} {problem}; set it to the gateway's admin token, or unset it to read --token-file"
            )
        return token
    unset = "unset" if given is None else "blank"
    if token_file is None:
        raise EmptyTokenFile(
            f"the path is empty and ${TOKEN_ENV} is {unset}; give the file the gateway wrote (WORK_DIR/{TOKEN_FILE})"
        )
    path = Path(token_file)
    if (bad := not_to_open(path)) is not None:  # a folder: read_text says so below
        raise QuantgateError(
            f"no admin token: ${TOKEN_ENV} is {unset} and --token-file {token_file} is {bad[0]}; {bad[1]}give the "
            f"file the gateway wrote (WORK_DIR/{TOKEN_FILE})"
        )
    try:
        token = Path(token_file).read_text().strip()
    except OSError as exc:
        raise QuantgateError(
            f"no admin token: ${TOKEN_ENV} is {unset} and --token-file {token_file} cannot be read ({exc.strerror}); "
            f"give the file the gateway wrote (WORK_DIR/{TOKEN_FILE})"
        ) from None
    except UnicodeDecodeError:  # no gateway wrote it
        raise QuantgateError(
            f"--token-file {token_file} is not UTF-8 text; give the file the gateway wrote (WORK_DIR/{TOKEN_FILE})"
        ) from None
    if (problem := token_problem(token)) is not None:
        raise QuantgateError(
            f"--token-file {token_file}: the token {problem}; give the file the gateway wrote (WORK_DIR/{TOKEN_FILE})"
        )
    return token


def samples_doc(samples: list[Sample], shadows: list[ShadowSample]) -> dict:
    return {"samples": [dataclasses.asdict(s) for s in samples], "shadows": [dataclasses.asdict(s) for s in shadows]}


def samples_of(doc: dict) -> tuple[list[Sample], list[ShadowSample]]:
    """The inverse of samples_doc."""
    return [Sample(**s) for s in doc["samples"]], [ShadowSample(**s) for s in doc["shadows"]]


def _refused(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status)


def admin_app(router, state: Callable[[], dict], token: str, webhook=None) -> Starlette:
    """The admin routes over `router` (gateway.router.Router); `state()` adds the gateway's own
    fields (url, pid, started_at, fleet) to /admin/state. `webhook`: the endpoint of a
    gateway.webhook.Receiver, served at POST /admin/webhook (None: no such route, 404)."""
    expected = f"Bearer {token}".encode()

    def guarded(handler):
        async def endpoint(request: Request):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                why = "no Authorization header" if not given else "a wrong token"
                return _refused(
                    f"admin endpoint: {why}; send `Authorization: Bearer <token>` "
                    f"(${TOKEN_ENV} or the gateway's {TOKEN_FILE})",
                    401,
                )
            return await handler(request)

        return endpoint

    async def get_state(request: Request) -> JSONResponse:
        backends = dataclasses.asdict(router.backends) if router.backends else {}
        labels = {role: (backends.get(role) or {}).get("label") for role in ("stable", "candidate", "shadow")}
        return JSONResponse(
            {
                **state(),
                "weight": router.weight,
                "shadow_fraction": router.params.shadow_fraction,
                "shadow_teams": router.shadow_teams,
                **labels,
            }
        )

    async def put_weight(request: Request) -> JSONResponse:
        try:
            percent = (await request.json())["percent"]
            ok = isinstance(percent, int | float) and not isinstance(percent, bool) and 0 <= percent <= 100
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            return _refused('give {"percent": p} with p a number from 0 to 100', 400)
        router.set_weight(float(percent))
        return JSONResponse({"weight": router.weight})

    async def get_samples(request: Request) -> JSONResponse:
        try:
            since = float(request.query_params.get("since", "0"))
        except ValueError:
            return _refused("since: epoch seconds, e.g. ?since=1764600000.5", 400)
        return JSONResponse(samples_doc(router.samples_since(since), router.shadows_since(since)))

    routes = [
        Route("/admin/state", guarded(get_state), methods=["GET"]),
        Route("/admin/weight", guarded(put_weight), methods=["PUT"]),
        Route("/admin/samples", guarded(get_samples), methods=["GET"]),
    ]
    if webhook is not None:  # the registry server holds no bearer token: the delivery's HMAC guards it
        routes.append(Route(WEBHOOK_PATH, webhook, methods=["POST"]))
    return Starlette(routes=routes)


NOT_SERVE = "it is not a `quantgate serve` admin endpoint: give the admin URL `quantgate serve` logs at start"


class GatewayUnreachable(QuantgateError):
    """The admin endpoint did not answer (the gateway is down or restarting)."""


class RemoteRouter:
    """A running gateway's split, over its admin endpoint: the controller's side of admin_app."""

    def __init__(self, url: str, token: str, timeout_s: float = 10.0):
        self.url = url.rstrip("/").removesuffix("/admin")  # serve's log line names .../admin
        if not token:
            raise QuantgateError("the admin token is empty: set $QUANTGATE_ADMIN_TOKEN or give a --token-file with it")
        try:
            self._http = httpx.Client(
                base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s, trust_env=False
            )
        except httpx.InvalidURL as exc:
            raise QuantgateError(f"--gateway {url!r}: not a URL ({exc})") from None

    def _call(self, method: str, path: str, **kw) -> dict:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.InvalidURL as exc:
            raise QuantgateError(f"--gateway {self.url!r}: not a URL ({exc})") from None
        except httpx.HTTPError as exc:
            raise GatewayUnreachable(
                f"admin endpoint {self.url} did not answer ({type(exc).__name__}); is `quantgate serve` running "
                "there? it logs its admin endpoint's URL at start"
            ) from None
        if r.status_code != 200:
            try:
                why = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                why = " ".join(r.text.split())[:200]  # one line, even for an HTML page
            hint = (
                "; is that `quantgate serve`'s admin endpoint? it logs its URL at start" if r.status_code == 404 else ""
            )
            raise QuantgateError(f"admin endpoint {self.url}{path}: HTTP {r.status_code}: {why}{hint}")
        try:
            return r.json()
        except ValueError:
            raise QuantgateError(f"admin endpoint {self.url}{path}: the answer is not JSON; {NOT_SERVE}") from None

    def state(self) -> dict:
        """GET /admin/state; QuantgateError if the answer is not a gateway's state (another server answers)."""
        s = self._call("GET", "/admin/state")
        if not (isinstance(s, dict) and isinstance(s.get("fleet"), dict) and "weight" in s):
            raise QuantgateError(
                f"admin endpoint {self.url}/admin/state: no weight and fleet in the answer; {NOT_SERVE}"
            )
        return s

    def set_weight(self, percent: float) -> None:
        self._call("PUT", "/admin/weight", json={"percent": percent})

    def samples_since(self, t: float) -> list[Sample]:
        return samples_of(self._call("GET", "/admin/samples", params={"since": repr(t)}))[0]

    def shadows_since(self, t: float) -> list[ShadowSample]:
        return samples_of(self._call("GET", "/admin/samples", params={"since": repr(t)}))[1]

    def drain(self) -> None:
        """Send nothing more to the candidate (weight 0)."""
        self.set_weight(0)

    def alive(self, version: str) -> bool:
        """The gateway runs a live server for `version`."""
        return bool(self.state()["fleet"].get(version, {}).get("alive"))

    def warm(self, version: str, state: dict | None = None) -> bool:
        """The gateway's router routes the candidate share to `version`'s live server."""
        s = state or self.state()
        return s.get("candidate") == f"v{version}" and bool(s["fleet"].get(version, {}).get("alive"))

    def wait_warm(self, version: str, timeout_s: float, stop=None, beat: Callable[[], None] = lambda: None) -> dict:
        """Poll /admin/state until `version` is warm (an unreachable gateway is polled again);
        returns that state. Raises GatewayUnreachable or QuantgateError after timeout_s."""
        deadline, last = time.monotonic() + timeout_s, "no answer yet"
        while True:
            try:
                s = self.state()
                if self.warm(version, s):
                    return s
                last = f"candidate {s.get('candidate')}, fleet {sorted(s['fleet'])}"
            except GatewayUnreachable as exc:
                last = str(exc)
            if time.monotonic() > deadline:
                raise GatewayUnreachable(f"v{version} not warm on the gateway after {timeout_s:g} s ({last})")
            beat()
            if stop is not None and stop.wait(1.0):
                raise QuantgateError("stopped by the operator (Ctrl-C or SIGTERM)")
            if stop is None:
                time.sleep(1.0)

    def close(self) -> None:
        self._http.close()
