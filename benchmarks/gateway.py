"""What the standing gateway (`quantgate serve`) costs: added latency per request, and the fleet's memory.

Against a running gateway (--url): reads /health for the serving build's vLLM URL, then sends the
same greedy requests (chat, non-streaming and streaming, `--max-tokens` tokens) alternately straight
to that vLLM server and through the gateway, one at a time (no queueing), `--n` of each. Rows per
path and kind: p50 and p99 of the whole request (s) and, for streams, of the time to the first
chunk (TTFT, s); the gateway's added latency is the difference of the medians. Memory: RSS of each
warm server's process group (vLLM API server, engine core, worker) and of the gateway process.

Run, with a gateway up (`quantgate serve MODEL` in another shell):
    .venv/bin/python -m benchmarks.gateway --url http://127.0.0.1:8000 [--n 40] [--max-tokens 8]
Switch latency and failed requests across a promote / rollback / killed server are measured by
tests/test_serve_e2e.py (printed lines "promote:", "kill:", "rollback:", "memory:").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import httpx
import psutil

from benchmarks.common import report, rounded
from quantgate.errors import QuantgateError, run_main

PROMPT = "In one word, what is the capital of France?"


def one(client: httpx.Client, base: str, model: str, stream: bool, max_tokens: int) -> tuple[float, float | None]:
    """(seconds for the whole request, seconds to the first stream chunk or None) of one chat request.
    Raises QuantgateError on a non-200 answer."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", f"{base}/chat/completions", json=body) as r:
        for chunk in r.iter_bytes():
            if first is None and chunk:
                first = time.perf_counter() - t0
        if r.status_code != 200:
            said = r.read().decode(errors="replace").strip()[:300]
            raise QuantgateError(f"{base}/chat/completions: HTTP {r.status_code}: {said or 'no body'}")
    return time.perf_counter() - t0, first if stream else None


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0-1) of xs, linear interpolation (statistics.quantiles, method inclusive)."""
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1] if len(xs) > 1 else xs[0]


def group_rss(pid: int) -> int:
    """Bytes of RSS of every process in process group `pid`."""
    total = 0
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pid:
                total += p.memory_info().rss
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return total


def process_rss(pid: int | None) -> str:
    """ "X.XX GiB RSS" of process `pid` on this machine, or why not (a gateway on another machine)."""
    try:
        return f"{psutil.Process(int(pid)).memory_info().rss / 2**30:.2f} GiB RSS"
    except (TypeError, ValueError, psutil.Error):
        return f"RSS unknown (pid {pid} is no process here)"


def failed_url(exc: httpx.HTTPError, default: str) -> str:
    """The URL of the request `exc` failed on (`default` for an error raised before one was sent)."""
    try:
        return str(exc.request.url)
    except RuntimeError:  # httpx raises it for an error without a request
        return default


def read_health(url: str) -> tuple[dict, dict, dict]:
    """(health, fleet, the serving build's entry) from the gateway's /health.
    Raises QuantgateError when nothing answers there or the answer names no warm serving build."""
    try:
        health = httpx.get(f"{url}/health", timeout=10).json()
    except (httpx.HTTPError, ValueError) as exc:
        raise QuantgateError(f"no gateway answers {url}/health ({exc}); start `quantgate serve MODEL`") from None
    fleet = health.get("fleet") if isinstance(health, dict) else None
    fleet = fleet if isinstance(fleet, dict) else {}
    serving = next((s for v, s in fleet.items() if f"v{v}" == health.get("stable")), None)
    if not isinstance(serving, dict) or not serving.get("url"):
        raise QuantgateError(f"{url}/health names no warm serving build: {str(health)[:300]}")
    return health, fleet, serving


def measure_paths(args: argparse.Namespace, serving: dict) -> dict[tuple[str, bool], list[tuple[float, float | None]]]:
    """{(path, stream): [(whole s, first chunk s)]}: `args.n` requests of each kind straight to the serving
    vLLM server and through the gateway, alternately, after one warm-up request per path."""
    with httpx.Client(timeout=300, trust_env=False) as client:
        try:
            model = client.get(f"{serving['url']}/models").json()["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise QuantgateError(f"{serving['url']}/models: no model listed; is it a vLLM server?") from None
        paths = {"direct": (serving["url"], model), "gateway": (f"{args.url}/v1", "any")}
        one(client, *paths["direct"], False, args.max_tokens)  # warm both paths once
        one(client, *paths["gateway"], False, args.max_tokens)
        times: dict[tuple[str, bool], list[tuple[float, float | None]]] = {}
        for i in range(args.n):
            for stream in (False, True):
                for path in ("direct", "gateway") if i % 2 == 0 else ("gateway", "direct"):
                    times.setdefault((path, stream), []).append(one(client, *paths[path], stream, args.max_tokens))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(prog="benchmarks.gateway", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the running gateway (no /v1)")
    ap.add_argument("--n", type=int, default=40, help="requests per path and kind (default 40)")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per answer (default 8)")
    args = ap.parse_args()
    if args.n < 2:
        raise QuantgateError(f"--n must be >= 2, got {args.n}")
    if args.max_tokens < 1:
        raise QuantgateError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    health, fleet, serving = read_health(args.url)
    try:
        times = measure_paths(args, serving)
    except httpx.HTTPError as exc:  # a server that died, a timeout: named with the URL it was asked
        raise QuantgateError(f"{failed_url(exc, args.url)}: {type(exc).__name__}: {exc}; is every server up?") from None
    rows = []
    for (path, stream), ts in times.items():
        total = [t for t, _ in ts]
        ttft = [f for _, f in ts if f is not None]
        rows.append(
            {
                "path": path,
                "kind": "stream" if stream else "whole",
                "n": len(ts),
                "p50_s": rounded(pct(total, 0.5), 4),
                "p99_s": rounded(pct(total, 0.99), 4),
                "ttft_p50_s": rounded(pct(ttft, 0.5), 4) if ttft else None,
                "ttft_p99_s": rounded(pct(ttft, 0.99), 4) if ttft else None,
            }
        )
    added = {
        kind: statistics.median(t for t, _ in times[("gateway", s)])
        - statistics.median(t for t, _ in times[("direct", s)])
        for kind, s in (("whole", False), ("stream", True))
    }
    memory = {v: round(group_rss(s["pid"]) / 2**30, 2) for v, s in fleet.items()}
    gateway_pid = health.get("pid")
    notes = [
        f"gateway adds {added['whole'] * 1000:.1f} ms (whole answers) and {added['stream'] * 1000:.1f} ms (streams) "
        f"at the median; serving build {health.get('stable')} at {serving['url']}",
        "memory (GiB RSS per warm server): " + ", ".join(f"v{v} ({fleet[v]['why']}) {m}" for v, m in memory.items()),
        f"gateway process {process_rss(gateway_pid)}; machine memory {psutil.virtual_memory().total / 2**30:.0f} GiB",
    ]
    report(
        "gateway",
        "quantgate serve: latency through the gateway vs straight to vLLM",
        rows,
        meta={"added_median_s": added, "memory_gib": memory, "gateway_pid": gateway_pid, "max_tokens": args.max_tokens},
        notes=notes,
    )


if __name__ == "__main__":
    run_main(main)
