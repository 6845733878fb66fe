"""The gateway's router: one OpenAI-compatible endpoint in front of a stable and a candidate build.

Routes: POST /v1/completions and /v1/chat/completions (streaming or not), GET /v1/models,
/health and /metrics (Prometheus text, this router's own registry).

- Split: each request goes to the candidate with probability weight/100 (`set_weight`,
  0-100), else to stable; with no candidate resolved, everything goes to stable. The
  request's "model" is rewritten to the chosen backend's served model name; responses are
  passed through unchanged, so they name the build that answered. Client headers are not
  forwarded (backends are internal); the response headers x-canary-role/-backend/-retried
  say who answered.
- Retry: each request has a chain of backends (`attempts`): the candidate when the split
  chose it, stable, then the fp16 `fallback` build (the shadow backend) when it is another
  server. An attempt that fails (connection error, timeout, HTTP 5xx, or a stream that ends or
  reports an error before its first chunk) moves to the next, so the client sees the next
  one's answer. The router waits for a stream's first chunk before answering; a stream that
  breaks (outcome "cut") or reports an engine error after that is resumed on the next
  backend: it continues the text already sent (gateway.payloads.continuation) and its chunks
  follow in the same response, so the client sees one whole answer. The last backend's
  stream that breaks, or a stream that cannot be continued (Router._next_leg), ends with an SSE
  `error` event. 4xx are the request's fault: passed through, not retried, counted as ok.
- Timeouts (RouterParams, params.yaml fleet.router): connect_timeout_s to connect; request_timeout_s for a whole
  non-streaming answer, for a stream's first chunk, and between later chunks.
- Shadow (RouterParams): a `shadow_fraction` sample of greedy requests (gateway.payloads.is_greedy:
  temperature given and 0, n = 1) answered successfully by the candidate is sent again,
  non-streaming, to the shadow (fp16 `fallback`) backend in a background task after the
  client got its answer; agreement = gateway.payloads.same_words on the first
  `shadow_compare_words` words. At most SHADOW_MAX_INFLIGHT run at once (more are skipped).
- Resolve: `resolve()` (a blocking callable, run in a worker thread) returns
  {"stable": Backend, "candidate": Backend | None, "shadow": Backend | None}; it is called
  at startup (failure = the router does not start) and then every RESOLVE_INTERVAL_S, so a
  registry alias flip moves traffic within interval + resolve time (`refresh_soon()`, e.g. on a
  registry webhook, resolves at once). A failing resolve keeps the last answer and is reported
  in /health.
- Limits (gateway.limits, optional): a request over the output cap or the context ceiling gets a
  400, one over its team's rate a 429 with Retry-After, before any backend is chosen; one
  without max_tokens gets the cap set for it.
- Samples (gateway.metrics.Sample): one per backend attempt. Streaming TTFT = first SSE
  chunk from the backend; TPOT = (total - TTFT) / (completion_tokens - 1), tokens from the
  usage chunk: the router adds stream_options.include_usage and drops the usage-only chunk
  again if the client did not ask for it; without usage, chunks with text are counted.
  Non-streaming answers arrive whole, so they have no TTFT/TPOT (total_s only).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import dataclass, field
from enum import StrEnum

import anyio
import httpx
from httpx_sse import EventSource, ServerSentEvent, SSEError
from pydantic import Field
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.limits import ANONYMOUS, Limiter
from gateway.metrics import OK_OUTCOMES, Recorder, Sample, ShadowSample
from gateway.payloads import (
    chunk_text,
    completion_tokens,
    continuation,
    first_choice,
    is_greedy,
    one_choice,
    other_delta,
    response_text,
    same_words,
    tokens_left,
)
from quantgate.errors import QuantgateError
from quantgate.params import Frozen

log = logging.getLogger("quantgate.canary")

RESOLVE_INTERVAL_S = 0.5
SHADOW_MAX_INFLIGHT = 16


class Role(StrEnum):
    """The roles a backend has for a request: STABLE takes the traffic the split does not send to the
    CANDIDATE; FALLBACK (the 16-bit build, alias `fallback`) answers what both failed. Shadowing is done to
    a request (a sampled greedy candidate request mirrored to the fallback), not a role: its samples are
    labelled SHADOWED."""

    STABLE = "stable"
    CANDIDATE = "candidate"
    FALLBACK = "fallback"


SHADOWED = "shadow"  # the samples of mirrored requests, and resolve()'s key for the fallback it mirrors to
ROLES = (Role.STABLE, Role.CANDIDATE, SHADOWED)  # resolve()'s keys


class RouterParams(Frozen):
    """What the router does with each request (params.yaml `fleet.router`; a canary without a standing
    gateway reads the same block): per-attempt timeouts and the shadow sample of greedy requests."""

    request_timeout_s: float = Field(default=60, gt=0)  # per backend attempt: the whole body, or between chunks
    connect_timeout_s: float = Field(default=5, gt=0)
    shadow_fraction: float = Field(default=0.5, ge=0, le=1)  # of greedy candidate requests, mirrored to fallback
    shadow_compare_words: int = Field(default=8, ge=1)  # whitespace-separated words compared


@dataclass(frozen=True)
class Schedule:
    """When a router re-reads its backends (resolve() every `resolve_interval_s`) and the `seed` of its draws
    (which requests go to the candidate, which are shadowed). The defaults serve; tests shorten the interval
    and fix the seed."""

    resolve_interval_s: float = RESOLVE_INTERVAL_S
    seed: int | None = None  # None: a fresh seed per router


@dataclass(frozen=True)
class Backend:
    """A served build: `url` is its OpenAI base URL ending in /v1 (quantgate.serving.Server.base_url),
    `model` its served model name, `label` what samples and metrics call it (e.g. "v3")."""

    url: str
    model: str
    label: str


@dataclass(frozen=True)
class Backends:
    stable: Backend
    candidate: Backend | None = None
    shadow: Backend | None = None


def backends_of(backends: Mapping[str, Backend | None]) -> Backends:
    """Check a resolve() answer. Raises QuantgateError on unknown roles, no stable, or non-Backends."""
    unknown = set(backends) - set(ROLES)
    if unknown:
        raise QuantgateError(f"resolve() returned unknown roles {sorted(unknown)}; expected {list(ROLES)}")
    if not isinstance(backends.get("stable"), Backend):
        raise QuantgateError(f"resolve() returned no stable Backend: {backends.get('stable')!r}")
    for role in ("candidate", "shadow"):
        if backends.get(role) is not None and not isinstance(backends[role], Backend):
            raise QuantgateError(f"resolve() returned a {type(backends[role]).__name__} for {role}, not a Backend")
    return Backends(backends["stable"], backends.get("candidate"), backends.get("shadow"))


Chain = list[tuple[Role, Backend]]  # (role, backend) to try in turn; see attempts()


def attempts(backends: Backends, to_candidate: bool) -> Chain:
    """The backends one request may use, in order: the candidate (when the split chose it), stable,
    then the `fallback` build (backends.shadow) when it is another server. A request that fails before
    its first byte moves to the next; a stream that breaks later is finished there (Router._relay)."""
    chain = [(Role.CANDIDATE, backends.candidate)] if to_candidate and backends.candidate is not None else []
    chain.append((Role.STABLE, backends.stable))
    if backends.shadow is not None and backends.shadow.url != backends.stable.url:
        chain.append((Role.FALLBACK, backends.shadow))
    return chain


def error(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """An OpenAI-style error body."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status, headers=headers)


def encode_sse(ev: ServerSentEvent) -> bytes:
    """One event back in SSE wire form (vLLM sends `data: ...` only, so bytes are unchanged)."""
    lines = [f"event: {ev.event}"] if ev.event != "message" else []
    lines += [f"id: {ev.id}"] if ev.id else []
    lines += [f"retry: {ev.retry}"] if ev.retry is not None else []
    lines += [f"data: {line}" for line in ev.data.split("\n")]
    return ("\n".join(lines) + "\n\n").encode()


@dataclass
class _Opened:
    """A streaming request after its first event (or its failure); see Router._open."""

    outcome: str  # "ok" or a failed/client_error outcome (gateway.metrics)
    status: int  # for the client: the backend's status, or 502/504
    what: str  # why it failed, for the client's error message
    status_seen: int = 0  # the backend's HTTP status for the sample (0 = no response)
    content: bytes | None = None  # a non-200 answer's body, passed on
    ctype: str = "application/json"
    upstream: httpx.Response | None = None
    events: AsyncIterator[ServerSentEvent] | None = None
    first: ServerSentEvent | None = None

    def __post_init__(self):
        if self.content is not None or self.first is not None:
            self.status_seen = self.status


@dataclass
class _Stream:
    """What a relayed stream has shown so far."""

    wants_usage: bool
    resumed: bool = False  # continues a broken stream (drop its role chunk, recount usage)
    resumed_from: int = 0  # chunks the broken stream had sent
    failed: bool = False  # the backend sent an error object in the stream
    text: list[str] = field(default_factory=list)
    chunks: int = 0  # chunks that carried text
    tokens: int | None = None  # usage.completion_tokens
    finished: bool = False  # a finish_reason or the usage chunk went by: the answer is whole
    done: bool = False  # [DONE] went by
    plain: bool = True  # only text so far (no tool calls or reasoning deltas): continuable

    def observe(self, ev: ServerSentEvent) -> bytes | None:
        """The bytes to send on for `ev`, None to drop it (the usage chunk the client did not ask for)."""
        self.done = self.done or ev.data.strip() == "[DONE]"
        try:
            chunk = json.loads(ev.data)
        except ValueError:  # "[DONE]" and anything else that is not JSON pass through untouched
            return encode_sse(ev)
        if not isinstance(chunk, dict):
            return encode_sse(ev)
        self.failed = self.failed or bool(chunk.get("error"))  # vLLM reports engine errors in-stream
        if text := chunk_text(chunk):
            self.text.append(text)
            self.chunks += 1
        self.plain = self.plain and not other_delta(chunk)
        self.finished = self.finished or bool(first_choice(chunk).get("finish_reason"))
        if (n := completion_tokens(chunk)) is not None:
            self.tokens, self.finished = n, True
        if chunk.get("choices") == [] and chunk.get("usage") and not self.wants_usage:
            return None
        if self.resumed:
            delta = first_choice(chunk).get("delta")
            if isinstance(delta, dict) and delta.get("role") and not delta.get("content") and not other_delta(chunk):
                return None  # the client had the role chunk already, from the broken stream
            usage = chunk.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                # the sent text was prompt to stable, but completion to the client
                n, prompt = self.resumed_from, usage.get("prompt_tokens")
                chunk["usage"] = {
                    **usage,
                    "completion_tokens": usage["completion_tokens"] + n,
                    "prompt_tokens": max(prompt - n, 0) if isinstance(prompt, int) else prompt,
                }
                return encode_sse(ServerSentEvent(data=json.dumps(chunk)))
        return encode_sse(ev)


@dataclass(frozen=True)
class _Attempt:
    """One try of one backend for a request: its role, the backend, whether it is a retry, and when it
    started (epoch seconds for the sample, perf_counter for durations)."""

    role: str
    backend: Backend
    retried: bool
    t: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class _Request:
    """One client request on its way: the backends resolved for it, the chain it may use, its path and body."""

    backends: Backends
    chain: Chain
    path: str
    body: dict
    team: str  # as the limits name it (gateway.limits.Limiter.team), for the shadow sample


@dataclass
class _Leg:
    """One backend's stream of a streaming answer: its attempt, the opened stream and its first event's bytes,
    what it has shown so far, the body it was asked (the client's, or a continuation), its place in the chain."""

    at: _Attempt
    opened: _Opened
    first: bytes | None
    state: _Stream
    body: dict
    index: int
    ttft: float | None
    outcome: str = "cancelled"  # stays so if the client goes away mid-stream


class Router:
    """State and ASGI app of one router (the gateway's, or a canary's own); serve `router.app`
    (gateway.server.RouterServer).

    `resolve` is called from a worker thread (every `schedule.resolve_interval_s`); `set_weight` and
    the sample accessors are safe to call from any thread.
    """

    def __init__(
        self,
        resolve: Callable[[], Mapping[str, Backend | None]],
        params: RouterParams,
        *,
        model_name: str = "quantgate",
        schedule: Schedule | None = None,
        health: Callable[[], dict] | None = None,
        limits: Limiter | None = None,
    ):
        self.params = params
        self.limits = limits  # None = no limits (gateway.limits: context, output cap, per-team rate)
        self.model_name = model_name  # the name /v1/models shows; clients may send any
        self.recorder = Recorder()
        self.registry = self.recorder.registry  # /metrics: add collectors here (e.g. the standing fleet's)
        self._health_extra = health  # more /health fields, e.g. the standing fleet's servers
        self.resolve_error: str | None = None  # the last resolve() failure, None after a success
        # (started, finished) wall-clock seconds of the last successful resolves, newest last: a request that
        # arrives after `finished` is routed by what the registry said at `started` or later
        self.resolves: collections.deque[tuple[float, float]] = collections.deque(maxlen=256)
        self._resolve = resolve
        schedule = schedule or Schedule()  # None: the serving defaults
        self._interval = schedule.resolve_interval_s
        self._rng = random.Random(schedule.seed)
        self._weight = 0.0
        self._backends: Backends | None = None
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the app's, for refresh_soon from other threads
        self._refresh_now: asyncio.Event | None = None
        self._shadow_tasks: set[asyncio.Task] = set()
        self._inflight: collections.Counter[str] = collections.Counter()  # open attempts by backend URL
        self.recorder.set_weight(0.0)
        if limits is not None:
            self.recorder.set_limits(limits.limits.gauges())
        self.app = Starlette(
            lifespan=self._lifespan,
            routes=[
                Route("/v1/completions", self._proxy, methods=["POST"]),
                Route("/v1/chat/completions", self._proxy, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
            ],
        )

    # --- controller API -------------------------------------------------------------
    @property
    def weight(self) -> float:
        """Percent of requests routed to the candidate."""
        return self._weight

    def set_weight(self, percent: float) -> None:
        """Route `percent` (0-100) of requests to the candidate from now on. Raises QuantgateError if out of range."""
        if not 0 <= percent <= 100:
            raise QuantgateError(f"candidate weight must be 0-100 percent, got {percent}")
        self._weight = float(percent)
        self.recorder.set_weight(self._weight)

    @property
    def backends(self) -> Backends | None:
        """The backends of the last successful resolve (None before the router started)."""
        return self._backends

    def refresh_soon(self) -> None:
        """Resolve the backends now instead of at the next interval (e.g. on a registry webhook).
        Safe from any thread; does nothing before the router started."""
        loop, event = self._loop, self._refresh_now
        if loop is not None and event is not None:
            with suppress(RuntimeError):  # the loop closed: the router has stopped
                loop.call_soon_threadsafe(event.set)

    def inflight(self, backend: Backend) -> int:
        """Attempts on `backend` that have started and not ended (a server is drained at 0)."""
        return self._inflight[backend.url]

    def samples_since(self, t: float) -> list[Sample]:
        """Backend attempts that started at or after `t` (time.time() seconds)."""
        return self.recorder.samples_since(t)

    def shadows_since(self, t: float) -> list[ShadowSample]:
        """Shadow comparisons made at or after `t`."""
        return self.recorder.shadows_since(t)

    @property
    def shadow_teams(self) -> int:
        """How many teams a shadow sample can name: those with their own rate limit and "anonymous" (every
        request, without limits); fixed before any request, so the canary can split its level among them."""
        return 1 + (len(self.limits.limits.rate_limits.teams) if self.limits is not None else 0)

    def drain(self) -> None:
        """Send nothing more to the candidate (weight 0)."""
        self.set_weight(0)

    # --- lifecycle ------------------------------------------------------------------
    @asynccontextmanager
    async def _lifespan(self, app):
        p = self.params
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(p.request_timeout_s, connect=p.connect_timeout_s),
            trust_env=False,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        try:
            started = time.time()
            self._backends = backends_of(await asyncio.to_thread(self._resolve))
            self.resolves.append((started, time.time()))
        except Exception as exc:
            self.resolve_error = f"{type(exc).__name__}: {exc}"
            await self._client.aclose()
            raise
        self._loop, self._refresh_now = asyncio.get_running_loop(), asyncio.Event()
        refresher = asyncio.create_task(self._refresh_forever())
        try:
            yield
        finally:
            refresher.cancel()
            for task in list(self._shadow_tasks):
                task.cancel()
            await asyncio.gather(refresher, *self._shadow_tasks, return_exceptions=True)
            await self._client.aclose()

    async def _refresh_forever(self) -> None:
        while True:
            try:  # the interval, or less when refresh_soon() is called
                await asyncio.wait_for(self._refresh_now.wait(), self._interval)
            except TimeoutError:
                pass
            self._refresh_now.clear()
            try:
                started = time.time()
                backends = backends_of(await asyncio.to_thread(self._resolve))
            except Exception as exc:  # resolve() is the controller's code (e.g. a registry call):
                # a transient failure must not stop routing, so keep the last answer
                if self.resolve_error is None:
                    log.warning("canary router: resolve() failed, keeping %s: %s", self._backends, exc)
                self.resolve_error = f"{type(exc).__name__}: {exc}"
                continue
            if backends != self._backends:
                log.info("canary router: backends now %s", backends)
            self._backends, self.resolve_error = backends, None
            self.resolves.append((started, time.time()))

    # --- routes ---------------------------------------------------------------------
    async def _models(self, request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "quantgate"}],
            }
        )

    async def _health(self, request: Request) -> Response:
        f = self._backends
        doc = {
            "status": "ok" if f else "unavailable",
            "weight": self._weight,
            "stable": f and f.stable.label,
            "candidate": f and f.candidate and f.candidate.label,
            "shadow": f and f.shadow and f.shadow.label,
            "resolve_error": self.resolve_error,
            "resolved": list(self.resolves[-1]) if self.resolves else None,  # [started, finished] wall-clock s
        }
        if self._health_extra is not None:
            doc.update(await asyncio.to_thread(self._health_extra))
        return JSONResponse(doc, 200 if f else 503)

    async def _metrics(self, request: Request) -> Response:
        body, content_type = self.recorder.exposition()
        return Response(body, headers={"content-type": content_type})

    async def _proxy(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return error(400, "request body must be a JSON object")
        path = request.url.path.removeprefix("/v1")
        if self.limits is not None and (no := self.limits.check(path, body, request.headers)) is not None:
            self.recorder.rejected(no.team, no.reason)
            return error(no.status, no.message, no.headers)
        backends = self._backends
        if backends is None:
            return error(503, "no backends resolved yet")
        attempt = self._stream if body.get("stream") is True else self._unary
        chain = attempts(backends, backends.candidate is not None and self._rng.random() * 100 < self._weight)
        team = self.limits.team(request.headers) if self.limits is not None else ANONYMOUS
        for i in range(len(chain)):
            response, failed = await attempt(_Request(backends, chain[i:], path, body, team), retried=i > 0)
            if not failed:
                break
        return response

    # --- one backend attempt; returns (response for the client, failed = retry it) ---
    def _record(
        self,
        at: _Attempt,
        outcome: str,
        status: int,
        *,
        stream: bool,
        ttft: float | None = None,
        tokens: int | None = None,
    ) -> None:
        self._inflight[at.backend.url] -= 1
        total = time.perf_counter() - at.t0
        tpot = (total - ttft) / (tokens - 1) if ttft is not None and tokens and tokens > 1 else None
        self.recorder.add(
            Sample(
                t=at.t,
                role=at.role,
                label=at.backend.label,
                ok=outcome in OK_OUTCOMES,
                status=status,
                ttft_s=ttft,
                tpot_s=tpot,
                retried=at.retried,
                total_s=total,
                stream=stream,
                outcome=outcome,
            )
        )

    async def _post(self, role: str, backend: Backend, path: str, body: dict, retried: bool):
        """POST a non-streaming request and record the sample.

        Returns (httpx response or None, outcome, the body as a dict or None if it is not a JSON object).
        """
        at = _Attempt(role, backend, retried)
        self._inflight[backend.url] += 1  # _record ends the attempt
        payload = {**body, "model": backend.model}
        try:
            async with asyncio.timeout(self.params.request_timeout_s):
                r = await self._client.post(backend.url + path, json=payload)
        except (TimeoutError, httpx.TimeoutException):
            self._record(at, "timeout", 0, stream=False)
            return None, "timeout", None
        except httpx.HTTPError:
            self._record(at, "connection_error", 0, stream=False)
            return None, "connection_error", None
        outcome = "ok" if r.status_code < 400 else "client_error" if r.status_code < 500 else "server_error"
        doc = _json_object(r)
        tokens = completion_tokens(doc) if outcome == "ok" and doc else None
        self._record(at, outcome, r.status_code, stream=False, tokens=tokens)
        return r, outcome, doc

    async def _unary(self, req: _Request, retried: bool) -> tuple[Response, bool]:
        path, body = req.path, req.body
        role, backend = req.chain[0]
        headers = _who(role, backend, retried)
        r, outcome, doc = await self._post(role, backend, path, body, retried)
        if r is None:
            status, what = (504, "timed out") if outcome == "timeout" else (502, "is unreachable")
            return error(status, f"{role} backend {what}", headers), True
        if role == Role.CANDIDATE and outcome == "ok" and doc:
            self._maybe_shadow(req, body, response_text(doc))
        ctype = r.headers.get("content-type", "application/json")
        return Response(r.content, r.status_code, headers={**headers, "content-type": ctype}), r.status_code >= 500

    async def _open(self, backend: Backend, path: str, payload: dict) -> _Opened:
        """POST a streaming request and wait for its first event, within request_timeout_s.

        Returns an _Opened with `first` set (the event, not yet observed; the caller owns
        `upstream`), or with `first` None and the failure: a non-200 answer in `content`, or
        no answer (timeout, connection error, a stream without events).
        """
        upstream = None
        self._inflight[backend.url] += 1  # the caller's _record ends the attempt
        try:
            async with asyncio.timeout(self.params.request_timeout_s):
                upstream = await self._client.send(
                    self._client.build_request("POST", backend.url + path, json=payload), stream=True
                )
                if upstream.status_code != 200:
                    content = await upstream.aread()
                    await upstream.aclose()
                    outcome = "client_error" if upstream.status_code < 500 else "server_error"
                    return _Opened(
                        outcome,
                        upstream.status_code,
                        f"answered HTTP {upstream.status_code}",
                        content=content,
                        ctype=upstream.headers.get("content-type", "application/json"),
                    )
                events = EventSource(upstream).aiter_sse()
                return _Opened("ok", 200, "", upstream=upstream, events=events, first=await anext(events))
        except (TimeoutError, httpx.TimeoutException):
            opened = _Opened("timeout", 504, "timed out before its first chunk")
        except (httpx.HTTPError, SSEError, StopAsyncIteration) as exc:
            opened = _Opened("connection_error", 502, f"failed before its first chunk ({type(exc).__name__})")
        except BaseException:  # cancelled (the client went away): do not leave the connection open
            if upstream is not None:
                with anyio.CancelScope(shield=True):
                    await upstream.aclose()
            raise
        if upstream is not None:
            opened.status_seen = upstream.status_code
            await upstream.aclose()
        return opened

    async def _stream(self, req: _Request, retried: bool) -> tuple[Response, bool]:
        path, body = req.path, req.body
        role, backend = req.chain[0]
        headers = _who(role, backend, retried)
        state = _Stream(wants_usage=bool(_stream_options(body).get("include_usage")))
        payload = _upstream_payload(body, backend.model)
        at = _Attempt(role, backend, retried)
        o = await self._open(backend, path, payload)
        if o.first is not None:
            first = state.observe(o.first)
            if not state.failed:
                leg = _Leg(at, o, first, state, body, 0, ttft=time.perf_counter() - at.t0)
                relay = self._relay(req, leg)
                ctype = o.upstream.headers.get("content-type", "text/event-stream")
                return StreamingResponse(relay, headers={**headers, "content-type": ctype}), False
            await o.upstream.aclose()
            o = _Opened("server_error", 502, "sent an error as its first chunk", status_seen=200)
        self._record(at, o.outcome, o.status_seen, stream=True)
        if o.content is not None:  # the backend's own answer (4xx passes through; 5xx is retried)
            return (Response(o.content, o.status, headers={**headers, "content-type": o.ctype}), o.status >= 500)
        return error(o.status, f"{role} backend {o.what}", headers), True

    async def _relay(self, req: _Request, leg: _Leg) -> AsyncIterator[bytes]:
        """Send a stream on, leg by leg: pass the backend's stream on (`_pass_on`); when it breaks, or reports
        an engine error, after its first chunk and a backend is left in the chain, finish the answer on the
        next one that answers (`_next_leg`: candidate -> stable -> fallback) and pass that on in turn. The
        last backend's stream that breaks ends with an SSE `error` event; a candidate's whole answer may be
        shadowed."""
        while True:
            resumable = leg.index + 1 < len(req.chain)
            async with aclosing(self._pass_on(leg, resumable)) as chunks:  # closed if the client leaves
                async for out in chunks:
                    yield out
            if not (resumable and leg.outcome in ("cut", "server_error")):
                if leg.at.role == Role.CANDIDATE and leg.outcome == "ok":
                    self._maybe_shadow(req, leg.body, "".join(leg.state.text))
                return
            nxt = await self._next_leg(req, leg)
            if not isinstance(nxt, _Leg):  # the answer ends here: [DONE], an SSE error, or nothing
                if nxt:
                    yield nxt
                return
            leg = nxt

    async def _pass_on(self, leg: _Leg, resumable: bool) -> AsyncIterator[bytes]:
        """Send one backend's stream on (its first event's bytes already observed) and record its attempt, in
        `leg.outcome` and a sample. A stream that breaks or reports an engine error is left unfinished for
        the next backend when `resumable`; else it ends with an SSE `error` event."""
        role, state = leg.at.role, leg.state
        try:
            if leg.first is not None:
                yield leg.first
            async for ev in leg.opened.events:
                out = state.observe(ev)
                if state.failed and resumable:
                    break  # do not pass the error on: the next backend finishes the answer
                if out is not None:
                    yield out
            if state.failed:
                leg.outcome = "server_error"
            elif state.done:
                leg.outcome = "ok"
            else:  # the body ended without [DONE]: the server went away between chunks
                leg.outcome = "cut"
                if not resumable:
                    yield _broke(f"{role} backend stream ended without [DONE]")
        except (httpx.HTTPError, SSEError):
            leg.outcome = "cut"
            if not resumable:
                yield _broke(f"{role} backend stream broke")
        finally:
            await leg.opened.upstream.aclose()
            tokens = state.tokens if state.tokens is not None else state.chunks
            self._record(leg.at, leg.outcome, 200, stream=True, ttft=leg.ttft, tokens=tokens)

    async def _next_leg(self, req: _Request, broken: _Leg) -> _Leg | bytes:
        """Where a stream that broke after its first chunk reached the client is finished: the leg of the next
        backend of the chain that answers (stable for a candidate, fallback for stable), or the bytes that end
        the answer instead (b"": nothing more).

        The next backend gets gateway.payloads.continuation of the request (the text sent so far as prompt
        suffix or final assistant message, token limits lowered by the chunks sent) and its chunks follow the
        broken stream's in the same response; its usage chunk counts the broken stream's tokens as completion
        tokens. Recorded as a retried attempt of its role without TTFT/TPOT (its first token is not the
        client's). A stream whose answer was already whole (a finish_reason, the usage chunk or [DONE] went
        by) or that has no tokens left just ends with [DONE]. A backend that fails before its first chunk (a
        4xx to the continuation included: it is the router's request) passes it on to the one after it; a
        request that cannot be continued (see continuation; also tool-call or reasoning deltas sent), or a
        last backend that fails too, ends the stream with an SSE `error` event.
        """
        body, sent, broken_role = broken.body, broken.state, broken.at.role
        if sent.done:
            return b""  # the stream was whole; only the connection's end was lost
        # with several choices the chunks interleave: choice 0's finish says nothing of the others
        if one_choice(body) and (sent.finished or tokens_left(body, sent.chunks) == 0):
            return b"data: [DONE]\n\n"  # the client has every token of the answer
        chat = req.path == "/chat/completions"
        cont = continuation(body, "".join(sent.text), sent.chunks, chat=chat) if sent.plain else None
        if cont is None:  # several choices included (continuation refuses them)
            nxt_role = req.chain[broken.index + 1][0]
            return _broke(f"{broken_role} backend stream broke and the request cannot be continued on {nxt_role}")
        for index in range(broken.index + 1, len(req.chain)):
            leg = await self._open_leg(req, index, cont, sent)
            if isinstance(leg, _Leg):
                return leg
        last_role, why = req.chain[-1][0], leg
        return _broke(f"{broken_role} backend stream broke and {last_role} could not continue it: {why}")

    async def _open_leg(self, req: _Request, index: int, cont: dict, sent: _Stream) -> _Leg | str:
        """Open `cont`, the continuation of a broken stream that showed `sent`, on chain[index]: its leg, or
        why it failed before its first chunk (recorded as a retried attempt)."""
        role, backend = req.chain[index]
        state = _Stream(wants_usage=sent.wants_usage, resumed=True, resumed_from=sent.chunks)
        payload = _upstream_payload(cont, backend.model)
        at = _Attempt(role, backend, retried=True)
        try:
            o = await self._open(backend, req.path, payload)
        except BaseException:  # the client went away while the next backend was asked
            self._record(at, "cancelled", 0, stream=True)
            raise
        first = state.observe(o.first) if o.first is not None else None
        if o.first is not None and not state.failed:
            return _Leg(at, o, first, state, cont, index, ttft=None)
        if o.upstream is not None:
            await o.upstream.aclose()
        outcome = "server_error" if o.first is not None or o.outcome == "client_error" else o.outcome
        self._record(at, outcome, o.status_seen, stream=True)
        return error_message(o.content) or o.what or "sent an error as its first chunk"

    # --- shadow ---------------------------------------------------------------------
    def _maybe_shadow(self, req: _Request, body: dict, text: str) -> None:
        """Mirror a sampled greedy candidate request (`body`, as the candidate got it) to the shadow backend, in
        the background."""
        backends = req.backends
        if backends.shadow is None or not is_greedy(body) or self._rng.random() >= self.params.shadow_fraction:
            return
        if len(self._shadow_tasks) >= SHADOW_MAX_INFLIGHT:
            self.recorder.shadow_not_compared("skipped", req.team)
            return
        task = asyncio.create_task(self._shadow(req, body, text))
        self._shadow_tasks.add(task)
        task.add_done_callback(self._shadow_tasks.discard)

    async def _shadow(self, req: _Request, body: dict, candidate_text: str) -> None:
        t, backends = time.time(), req.backends
        plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        _, outcome, doc = await self._post(SHADOWED, backends.shadow, req.path, plain, retried=False)
        if outcome != "ok" or not doc:
            self.recorder.shadow_not_compared("error", req.team)
            return
        agree = same_words(candidate_text, response_text(doc), self.params.shadow_compare_words)
        self.recorder.add_shadow(
            ShadowSample(
                t=t, agree=agree, candidate=backends.candidate.label, shadow=backends.shadow.label, team=req.team
            )
        )


def _broke(message: str) -> bytes:
    """The SSE `error` event that ends a stream which broke after its first chunk."""
    return encode_sse(
        ServerSentEvent(
            event="error", data=json.dumps({"error": {"message": message, "type": "server_error", "code": 502}})
        )
    )


def error_message(content: bytes | None) -> str | None:
    """The message of an OpenAI-style error body on one line (its runs of whitespace, newlines included, as one
    space: vLLM's validation errors span lines) and at most 200 characters, None if there is none."""
    try:
        doc = json.loads(content or b"")
    except ValueError:
        return None
    err = doc.get("error") if isinstance(doc, dict) else None
    msg = err.get("message") if isinstance(err, dict) else err if isinstance(err, str) else None
    return " ".join(str(msg).split())[:200].rstrip() or None if msg else None


def _stream_options(body: dict) -> dict:
    return body["stream_options"] if isinstance(body.get("stream_options"), dict) else {}


def _upstream_payload(body: dict, model: str) -> dict:
    """A streaming request for a backend: its served model name, and usage asked for (TPOT needs
    the token count; _Stream drops the usage chunk again if the client did not ask for it)."""
    return {**body, "model": model, "stream": True, "stream_options": {**_stream_options(body), "include_usage": True}}


def _who(role: str, backend: Backend, retried: bool) -> dict[str, str]:
    return {"x-canary-role": role, "x-canary-backend": backend.label, "x-canary-retried": str(int(retried))}


def _json_object(r: httpx.Response) -> dict | None:
    """The body as a JSON object, None if it is not one (a 200 with garbage is no answer to compare)."""
    try:
        doc = r.json()
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None
