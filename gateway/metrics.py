"""Per-request samples and shadow comparisons of one router, kept for analysis and exported
to Prometheus through the router's own CollectorRegistry (never the global one).

Times: `t` is time.time() (epoch seconds) when the router chose the backend; durations in
seconds. Thread-safe: the router's event loop writes, the controller's thread reads.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

MAX_KEPT = 200_000  # samples (and comparisons) kept in memory, oldest dropped first

# Outcomes of one backend attempt. ok: "ok", "client_error" (4xx: the request's fault, not
# the backend's), "cancelled" (the client went away mid-stream). Failed: "server_error" (5xx,
# or an error object in the stream), "timeout", "connection_error", "cut" (the stream broke
# after its first byte reached the client; a candidate's is then finished on stable).
OK_OUTCOMES = {"ok", "client_error", "cancelled"}

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass(frozen=True)
class Sample:
    """One backend attempt. ttft_s: first stream chunk (streaming only; a non-streaming body
    arrives whole, so it has no TTFT); tpot_s = (total_s - ttft_s) / (completion_tokens - 1),
    None with fewer than 2 tokens. status 0 = no HTTP response (timeout, refused)."""

    t: float
    role: str  # "stable" | "candidate" | "fallback" (a retry on the fp16 build) | "shadow"
    label: str  # the backend's label, e.g. the model version
    ok: bool  # outcome in OK_OUTCOMES
    status: int
    ttft_s: float | None
    tpot_s: float | None
    retried: bool  # this attempt retried a failed attempt on the backend before it
    total_s: float
    stream: bool
    outcome: str


@dataclass(frozen=True)
class ShadowSample:
    """A greedy candidate answer compared with the shadow (fp16) build's answer."""

    t: float
    agree: bool
    candidate: str  # candidate label
    shadow: str  # shadow label
    # the request's team as the gateway's limits name it (gateway.limits.Limiter.team); "anonymous" (limits.ANONYMOUS)
    # for one that names none, a team without its own rate limit, or a gateway without limits
    team: str = "anonymous"


class Recorder:
    def __init__(self, max_kept: int = MAX_KEPT):
        self.registry = CollectorRegistry()
        r = self.registry
        self._requests = Counter(
            "canary_requests", "Backend attempts by role and outcome", ["role", "outcome"], registry=r
        )
        self._retries = Counter(
            "canary_retries", "Requests retried on the next backend (candidate -> stable -> fallback)", registry=r
        )
        self._ttft = Histogram(
            "canary_ttft_seconds", "Time to first stream chunk", ["role"], buckets=TTFT_BUCKETS, registry=r
        )
        self._tpot = Histogram(
            "canary_tpot_seconds", "Time per output token after the first", ["role"], buckets=TPOT_BUCKETS, registry=r
        )
        self._latency = Histogram(
            "canary_request_seconds", "Backend attempt duration", ["role"], buckets=LATENCY_BUCKETS, registry=r
        )
        self._weight = Gauge(
            "canary_candidate_weight_percent", "Percent of traffic routed to the candidate", registry=r
        )
        self._shadow = Counter(
            "canary_shadow_comparisons",
            "Shadow comparisons by result (agree, disagree; "
            "error = shadow request failed, skipped = too many in flight) and the request's team as the limits "
            "name it (anonymous for none)",
            ["result", "team"],
            registry=r,
        )
        self._limit = Gauge(
            "canary_limit",
            "Configured limits per team (gateway/limits.py; rps, burst, *_tokens)",
            ["team", "limit"],
            registry=r,
        )
        self._rejected = Counter(
            "canary_rejected_requests",
            "Requests refused by the limits, by team and reason",
            ["team", "reason"],
            registry=r,
        )
        self._samples: deque[Sample] = deque(maxlen=max_kept)
        self._shadows: deque[ShadowSample] = deque(maxlen=max_kept)
        self._lock = threading.Lock()

    def add(self, s: Sample) -> None:
        with self._lock:
            self._samples.append(s)
        self._requests.labels(s.role, s.outcome).inc()
        self._retries.inc(s.retried)
        self._latency.labels(s.role).observe(s.total_s)
        if s.ttft_s is not None:
            self._ttft.labels(s.role).observe(s.ttft_s)
        if s.tpot_s is not None:
            self._tpot.labels(s.role).observe(s.tpot_s)

    def add_shadow(self, s: ShadowSample) -> None:
        with self._lock:
            self._shadows.append(s)
        self._shadow.labels("agree" if s.agree else "disagree", s.team).inc()

    def shadow_not_compared(self, reason: str, team: str) -> None:
        """Count a sampled request of `team` (ShadowSample.team) that was not compared: "error" (shadow failed) or
        "skipped" (too many in flight)."""
        self._shadow.labels(reason, team).inc()

    def set_limits(self, rows: list[tuple[str, str, float]]) -> None:
        """Show (team, limit, value) rows, gateway.limits.Limits.gauges()."""
        for team, limit, value in rows:
            self._limit.labels(team, limit).set(value)

    def rejected(self, team: str, reason: str) -> None:
        self._rejected.labels(team, reason).inc()

    def set_weight(self, percent: float) -> None:
        self._weight.set(percent)

    def samples_since(self, t: float) -> list[Sample]:
        """Samples with s.t >= t (epoch seconds), oldest first."""
        with self._lock:
            return [s for s in self._samples if s.t >= t]

    def shadows_since(self, t: float) -> list[ShadowSample]:
        with self._lock:
            return [s for s in self._shadows if s.t >= t]

    def exposition(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
