"""The candidate's own vLLM gauges, scraped from its Prometheus `/metrics` at each canary look.

vLLM exports (vllm/v1/metrics/loggers.py, vLLM 0.32):
  vllm:num_requests_waiting   requests queued, not yet scheduled (one series per engine/model)
  vllm:kv_cache_usage_perc    KV-cache blocks in use, a fraction 0-1 despite the name
The design chapter names both as the leading indicators of an SLO miss: a queue that grows, or a
KV cache that fills (then vLLM preempts), comes before TTFT and TPOT degrade.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"


@dataclass(frozen=True)
class EngineSample:
    """One scrape of a vLLM server: `t` epoch seconds; `waiting` requests (summed over the
    server's engines); `kv_usage` the fraction of KV-cache blocks in use (the largest engine's)."""

    t: float
    label: str  # the backend's label, e.g. "v3"
    waiting: float | None
    kv_usage: float | None


def metrics_url(base_url: str) -> str:
    """vLLM's /metrics from its OpenAI base URL (".../v1")."""
    return base_url.rstrip("/").removesuffix("/v1") + "/metrics"


def parse(text: str, label: str, t: float) -> EngineSample:
    """The two gauges from a Prometheus text exposition (prometheus_client's parser); a gauge
    that is absent is None. Raises ValueError on text that is not an exposition."""
    waiting: list[float] = []
    usage: list[float] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == WAITING:
                waiting.append(s.value)
            elif s.name == KV_USAGE:
                usage.append(s.value)
    return EngineSample(t, label, sum(waiting) if waiting else None, max(usage) if usage else None)


def scrape(base_url: str, label: str, timeout_s: float = 2.0) -> EngineSample | None:
    """One scrape of the server at `base_url`; None when it does not answer with an exposition
    (the check then has one look fewer, it is not counted as a pass)."""
    t = time.time()
    try:
        r = httpx.get(metrics_url(base_url), timeout=timeout_s, trust_env=False)
        r.raise_for_status()
        return parse(r.text, label, t)
    except (httpx.HTTPError, ValueError):
        return None
