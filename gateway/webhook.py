"""MLflow registry webhooks for `quantgate serve`: the registry tells the gateway of an alias change
as it is written, so the planner runs at once instead of at its next poll (`fleet.poll_s`).

Only an `mlflow server` (an http(s) tracking URI, SQL store) delivers webhooks; with a sqlite file
URI the gateway polls only. At start (`register`) the gateway
1. deletes webhooks of its own name (`webhook_name(url)`: the same callback URL, which only it can
   be listening on now, so they are left by an earlier gateway that was killed),
2. creates one for events `model_version_alias.created` and `.deleted`, with a new random secret and
   the callback URL `fleet.webhook_url` (default: its admin endpoint's `/admin/webhook`),
3. asks the server to send it a test delivery (`MlflowClient.test_webhook`), so a server that cannot
   reach the URL is named in the log at start; the webhook is then deleted and polling carries on.
At stop it deletes the webhook (`Registration.close`).

Each delivery (`Receiver`) is checked as MLflow signs it (mlflow/webhooks/delivery.py, after the
Standard Webhooks scheme, https://www.standardwebhooks.com): header X-MLflow-Signature is
"v1,<base64 HMAC-SHA256(secret, f'{delivery_id}.{timestamp}.{body}')>" (several may be given,
space-separated), X-MLflow-Timestamp the Unix seconds it was sent, X-MLflow-Delivery-Id a UUID.
A missing or malformed header or body answers 400 (a body over 64 KiB: 413, unread), a wrong
signature or a timestamp more than MAX_AGE_S (300 s) from now 401 (a replay), each with a one-line
message; a delivery id seen within that window answers 200 and is not acted on again. A valid
event for the served model calls `on_alias(alias, version)` (version None for a deletion); other
models' events answer 200, ignored.

The server side needs (MLflow 3.17): MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https for an http callback
URL (the default allows https only), MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true for a loopback or
private address (blocked by default against SSRF), and a short MLFLOW_WEBHOOK_CACHE_TTL: the server
caches the webhook list per event for that many seconds (default 60), so a new gateway's webhook may
get its first event only that long after it registered. Polling covers that time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse

EVENTS = ("model_version_alias.created", "model_version_alias.deleted")
SIGNATURE, TIMESTAMP, DELIVERY_ID = "x-mlflow-signature", "x-mlflow-timestamp", "x-mlflow-delivery-id"
MAX_AGE_S = 300  # a delivery older (or further in the future) than this is refused as a replay
PATH = "/admin/webhook"  # on the admin endpoint (gateway/admin.py)
MAX_BODY = 65536  # bytes; larger deliveries are refused unread


class Rejected(Exception):
    """A delivery that is not acted on: `status` (400 malformed, 401 not signed by our secret or
    stale) and a one-line `message`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    """The X-MLflow-Signature value MLflow sends: "v1,<base64 HMAC-SHA256 of
    f"{delivery_id}.{timestamp}.{body}" with `secret`>" (mlflow.webhooks.delivery)."""
    content = f"{delivery_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(secret.encode(), content, hashlib.sha256).digest()).decode()


def verify(secret: str, headers: Mapping[str, str], body: bytes, now: float, max_age_s: float = MAX_AGE_S) -> dict:
    """The delivery's payload ({entity, action, timestamp, data}) if it is signed with `secret` and
    sent within `max_age_s` of `now` (Unix seconds). Header names are matched lower-case (starlette's
    Headers ignore case). Raises Rejected (400 or 401, message names the header) otherwise."""
    delivery_id, timestamp, given = (headers.get(h, "").strip() for h in (DELIVERY_ID, TIMESTAMP, SIGNATURE))
    for name, value in ((DELIVERY_ID, delivery_id), (TIMESTAMP, timestamp), (SIGNATURE, given)):
        if not value:
            raise Rejected(400, f"webhook: no {name} header; only an MLflow registry webhook may call this")
    if not re.fullmatch(r"\d{1,12}", timestamp):
        raise Rejected(400, f"webhook: {TIMESTAMP} {timestamp[:40]!r} is not Unix seconds")
    expected = sign(secret, delivery_id, timestamp, body)
    # constant-time compare with each signature given ("v1,a v1,b" when a secret is being rotated)
    if not any(hmac.compare_digest(s.encode(), expected.encode()) for s in given.split()):
        raise Rejected(401, f"webhook: {SIGNATURE} does not match this gateway's secret")
    age = now - int(timestamp)
    if abs(age) > max_age_s:
        when = f"sent {age:.0f} s ago" if age > 0 else f"dated {-age:.0f} s ahead"
        raise Rejected(401, f"webhook: {when}, outside +-{max_age_s:g} s; refused as a replay")
    try:
        payload = json.loads(body)
    except ValueError:
        raise Rejected(400, "webhook: the body is not JSON") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), dict):
        raise Rejected(400, "webhook: the body has no `data` object")
    return payload


class Receiver:
    """The gateway's side of the webhook: `endpoint` is the Starlette route for PATH.

    `on_alias(alias, version)` is called (from the admin server's event loop: it must not block) for
    each valid, new alias event of `model`. `clock` gives Unix seconds.
    """

    def __init__(
        self,
        secret: str,
        model: str,
        on_alias: Callable[[str, str | None], None],
        clock: Callable[[], float] = time.time,
    ):
        self.secret, self.model, self.on_alias, self.clock = secret, model, on_alias, clock
        self._seen: dict[str, float] = {}  # delivery id -> when, for MAX_AGE_S
        self._lock = threading.Lock()
        self.received = 0  # valid deliveries

    def handle(self, headers: Mapping[str, str], body: bytes) -> dict:
        """The answer to a delivery (a JSON object); raises Rejected. Calls on_alias for an alias event of our model."""
        now = self.clock()
        payload = verify(self.secret, headers, body, now)
        delivery = headers.get(DELIVERY_ID, "").strip()
        with self._lock:
            self._seen = {d: t for d, t in self._seen.items() if now - t <= MAX_AGE_S}
            if delivery in self._seen:
                return {"status": "duplicate"}
            self._seen[delivery] = now
            self.received += 1
        data, entity = payload["data"], payload.get("entity")
        if entity != "model_version_alias" or data.get("name") != self.model:
            return {"status": "ignored"}  # the server's test delivery, another model's alias
        self.on_alias(str(data.get("alias")), None if data.get("version") is None else str(data["version"]))
        return {"status": "planning"}

    async def endpoint(self, request: Request) -> JSONResponse:
        try:
            body = b""
            async for chunk in request.stream():  # an alias event is ~200 bytes: read no more than MAX_BODY
                body += chunk
                if len(body) > MAX_BODY:
                    raise Rejected(413, f"webhook: the body is over {MAX_BODY} bytes")
            return JSONResponse(self.handle(request.headers, body))
        except Rejected as exc:
            return JSONResponse({"error": {"message": exc.message, "code": exc.status}}, exc.status)


def webhook_name(url: str) -> str:
    """The webhook's name in the registry: from the callback URL, which only one gateway can listen
    on at a time (MLflow names: letters, digits, . _ -, under 63 characters)."""
    return f"quantgate-serve-{hashlib.sha256(url.encode()).hexdigest()[:16]}"


def registry_server(mlflow_client) -> bool:
    """True when the registry is an `mlflow server` (http(s) URI), the only kind that delivers webhooks."""
    return str(getattr(mlflow_client, "tracking_uri", "")).startswith(("http://", "https://"))


@dataclass
class Registration:
    """A webhook this gateway registered; close() deletes it (never raises: the gateway is stopping)."""

    client: object
    webhook_id: str
    url: str
    secret: str
    log: Callable[[str], None]

    def close(self) -> None:
        try:
            self.client.delete_webhook(self.webhook_id)
            self.log(f"serve: registry webhook to {self.url} deleted")
        except Exception as exc:  # the registry may be gone too; the next gateway deletes it by name
            self.log(f"serve: could not delete the registry webhook {self.webhook_id}: {_why(exc)}")


def register(
    mlflow_client, model: str, url: str, secret: str, log: Callable[[str], None] = print
) -> Registration | None:
    """Register this gateway's webhook, signed with `secret`, at the registry server (module
    docstring: stale ones of its name deleted, a test delivery). Returns None, having said why in one
    log line, when the server refuses it or cannot reach `url`; the gateway then follows the registry
    by polling only. The caller serves a Receiver with `secret` at `url` before calling this (the
    test delivery arrives during the call)."""
    name = webhook_name(url)
    try:
        stale = [w for w in _all_webhooks(mlflow_client) if w.name == name]
        for w in stale:
            mlflow_client.delete_webhook(w.webhook_id)
        if stale:
            log(f"serve: deleted {len(stale)} registry webhook(s) to {url} left by an earlier gateway")
        hook = mlflow_client.create_webhook(
            name=name,
            url=url,
            events=list(EVENTS),
            description=f"quantgate serve {model}: alias changes wake its planner",
            secret=secret,
        )
    except Exception as exc:
        log(f"serve: registry webhook not registered ({_why(exc)}); following the registry by polling only")
        return None
    registration = Registration(mlflow_client, hook.webhook_id, url, secret, log)
    try:
        result = mlflow_client.test_webhook(hook.webhook_id)
        ok = result.success
        why = "" if ok else result.error_message or f"HTTP {result.response_status}: {result.response_body}"
    except Exception as exc:
        ok, why = False, _why(exc)
    if not ok:
        registration.close()
        why = " ".join(str(why).split())[:300]
        log(
            f"serve: the registry server could not deliver a test webhook to {url} ({why}); "
            "set fleet.webhook_url to an address it can reach; following the registry by polling only"
        )
        return None
    log(f"serve: registry webhook registered: alias changes are pushed to {url} (polling stays as the fallback)")
    return registration


def _all_webhooks(mlflow_client) -> list:
    out, token = [], None
    while True:
        page = mlflow_client.list_webhooks(max_results=100, page_token=token)
        out += list(page)
        token = page.token
        if not token:
            return out


def _why(exc: Exception) -> str:
    """One line: an MlflowException's message (e.g. the server's refusal of an http URL), else the type and text."""
    text = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
    return " ".join(str(text).split())[:300]
