"""A build's profile measured on a vLLM server that is already running, and the content cache of profiles.

A private helper of the profile stage (pipeline/profile.py), which starts a server for the build and measures
it here, and of the evaluate stage (pipeline/evaluate.py), which measures on the server it started to score the
build when the profile stage would start the same one (`profile_on_evaluate_server`): one server per build
instead of two, each start being three Python processes importing vLLM in turn (benchmarks/README.md: 33-47 s
on 2 cores). The figures are the same either way: the measurement comes first, on a server that has answered
only the start's smoke request, before any team is scored on it.

What is measured (module docstring of pipeline/profile.py): vLLM's start-up report (weights memory, KV-cache
capacity in tokens, the most concurrent requests of max_model_len tokens), the arithmetic KV capacity
(quantgate/cost.py) and vLLM's serving benchmark at each of `profile.concurrency` (quantgate/loadgen.py).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import asdict
from pathlib import Path

from quantgate.cost import KVShape, kv_bytes_per_token, kv_capacity_tokens, kv_dtype_bytes
from quantgate.errors import QuantgateError, project_relative
from quantgate.hashing import digest_json
from quantgate.loadgen import Load, bench_loads, disk_mib, startup_report, tree_rss_gib
from quantgate.manifest import config_digest, read_manifest
from quantgate.precision import probe, probe_key
from quantgate.profile_params import ProfileParams
from quantgate.results import BuildProfile, LoadPoint, read_profile, write_profile
from quantgate.serving import ServeParams, Server, kv_cache_dtype, resolved

CACHE_DIR = Path(".quantgate/cache/profile")
# bump when what a profile measures or records changes (this module, quantgate/loadgen.py): older entries then miss
CODE_VERSION = 3  # 2: records name the server they were measured on (measured_on); 3: no TPOT of 0 (loadgen)
MEASURE_ERRORS = (QuantgateError, subprocess.TimeoutExpired, OSError, ValueError)  # what unprofiles a build


def profile_serve(serve: ServeParams, params: ProfileParams) -> ServeParams:
    """The serving settings a build is profiled with: evaluate.serve, with `profile.cpu_cores` where it is set."""
    return serve.model_copy(update={"cpu_cores": params.cpu_cores}) if params.cpu_cores else serve


def first_record(build: str, model_dir: Path, params: ProfileParams) -> dict:
    """The profile record's fields that need no server: the build, the load and the weights' MiB on disk."""
    return {
        "build": build,
        "input_len": params.input_len,
        "output_len": params.output_len,
        "seed": params.seed,
        "weights_mib": disk_mib(model_dir),
    }


def add_served(record: dict, model_dir: Path, serve: ServeParams) -> ServeParams:
    """Add to `record` (in place) what the server will be: the KV cache dtype, the activation dtype and the
    arithmetic KV figures; return `serve` resolved for `model_dir` (dtype, eager mode, KV space) as the server
    gets it. Raises QuantgateError (a serving env that cannot be probed, a config field missing)."""
    kv_dtype = record["kv_cache_dtype"] = kv_cache_dtype(model_dir)
    serve = resolved(serve, model_dir)
    record["dtype"] = serve.dtype
    record |= arithmetic_kv(model_dir, serve, kv_dtype, probe(serve.python).is_cpu)
    return serve


def measure(server: Server, model_dir: Path, serve: ServeParams, params: ProfileParams, record: dict) -> BuildProfile:
    """Measure the build `server` serves (started with `serve`, resolved; `record` from first_record and
    add_served): its start-up report and vLLM's benchmark at each of `params.concurrency` (bench_loads),
    printing each load point. Returns the "profiled" BuildProfile. Raises what bench_loads raises (QuantgateError,
    subprocess.TimeoutExpired) and quantgate.serving.ServerDied when the server dies under the benchmark."""
    load = Load(params.input_len, params.output_len, params.seed, params.timeout_s)
    build = record["build"]
    with tempfile.TemporaryDirectory(prefix="profile-") as tmp, server.deaths():
        facts = startup_report(server.log_path.read_text(errors="replace"))
        record = record | {
            "kv_tokens": facts.kv_tokens,
            "max_concurrency": facts.max_concurrency,
            "max_concurrency_at": facts.max_concurrency_at,
            "weights_gib": facts.weights_gib,
            "weights_source": facts.weights_source,
            "server_rss_gib": tree_rss_gib(server.pid),
        }
        arithmetic = record["kv_tokens_arithmetic"]
        print(f"profile[{build}]: vLLM reports {facts.kv_tokens} KV tokens (arithmetic: {arithmetic})", flush=True)
        points = [(c, max(params.prompts_per_concurrency, c)) for c in params.concurrency]
        results = bench_loads(serve.python, server.base_url, server.name, model_dir.resolve(), points, load, Path(tmp))
        loads = {}
        for (c, n), r in zip(points, results, strict=True):
            loads[f"c{c}"] = p = load_point(c, n, r)
            print(
                f"profile[{build}]: C={c}: {p.output_tokens_per_s:.1f} tok/s, TTFT p50 {p.ttft_ms_p50:.0f} ms, "
                f"TPOT p50 {p.tpot_ms_p50:.0f} ms",
                flush=True,
            )
    return BuildProfile(status="profiled", loads=loads, **record)


def unprofiled_reason(exc: BaseException, params: ProfileParams) -> str:
    """One line of why a build could not be measured (paths relative to the project)."""
    if isinstance(exc, subprocess.TimeoutExpired):
        return f"vllm bench serve took longer than profile.timeout_s ({params.timeout_s} s)"
    return project_relative((str(exc).strip() or type(exc).__name__).split(" (log: ")[0].splitlines()[0])


def arithmetic_kv(model_dir: Path, serve: ServeParams, kv_dtype: str, on_cpu: bool) -> dict:
    """{kv_shape, kv_bytes_per_token, kv_tokens_arithmetic} for the build's config.json at the served
    precision (quantgate/cost.py); kv_tokens_arithmetic = tokens that fit in evaluate.serve.kv_cache_gib
    GiB, None off a CPU (a GPU's KV space is what its memory leaves). Raises QuantgateError naming the
    config field that is missing, or kv_cache_dtype when it cannot be sized."""
    shape = KVShape.from_config(json.loads((model_dir / "config.json").read_text()), f"{model_dir}/config.json")
    per_token = kv_bytes_per_token(shape, kv_dtype_bytes(kv_dtype, serve.dtype))
    return {
        "kv_shape": asdict(shape),
        "kv_bytes_per_token": per_token,
        "kv_tokens_arithmetic": kv_capacity_tokens(serve.kv_cache_gib * 2**30, per_token) if on_cpu else None,
    }


def load_point(c: int, n: int, r: dict) -> LoadPoint:
    """One benchmark result (vLLM's result JSON, quantgate.loadgen.bench_loads) as a LoadPoint, rounded for reading."""
    return LoadPoint(
        concurrency=c,
        prompts=n,
        output_tokens_per_s=round(r["output_throughput"], 3),
        requests_per_s=round(r["request_throughput"], 4),
        ttft_ms_p50=round(r["p50_ttft_ms"], 1),
        ttft_ms_p99=round(r["p99_ttft_ms"], 1),
        tpot_ms_p50=round(r["p50_tpot_ms"], 1),
        tpot_ms_p99=round(r["p99_tpot_ms"], 1),
    )


def cache_key(model_dir: Path, serve: ServeParams, params: ProfileParams) -> str | None:
    """Content key of one build's profile (sha256 hex), or None where it cannot be formed (no build.json,
    a serving env that cannot be probed): then the build is measured. In it is everything that changes the
    figures: the weights and config/tokenizer files with the build's own serving settings (KV cache dtype, W4A8:
    quantgate.manifest.config_digest), the serving settings as resolved here (precision, eager mode, KV space,
    cores, extra flags), the serving env and the machine (quantgate.precision.probe_key: its packages, the CPU
    flags, the GPUs) and the load. Not the
    build's name: two builds with the same weights (int4-mixed when its search keeps no layer 16-bit) are
    one measurement, as evaluate's cache makes them one scoring."""
    try:
        weights = read_manifest(model_dir)["weights_digest"]
        served = {k: v for k, v in dict(resolved(serve, model_dir)).items() if k not in ("python", "host", "port")}
        return digest_json(
            {
                "weights": weights,
                "model_files": config_digest(model_dir),
                "kv_cache_dtype": kv_cache_dtype(model_dir),
                "serve": served,
                "platform": probe_key(serve.python),
                "load": params.model_dump(mode="json", exclude={"timeout_s"}),
                "code": CODE_VERSION,
            }
        )
    except (QuantgateError, KeyError, OSError):
        return None


def cached(build: str, key: str | None) -> BuildProfile | None:
    """The profile kept under `key` in CACHE_DIR, as `build`'s (marked `measured_as` the build it was measured
    on, when that is another build: int4-mixed with int4's weights), or None when there is none or it is
    unusable (then it is measured again and replaced). `build`'s own record comes back as it was kept, so
    results/profile/<build>.json is byte for byte the same and DVC does not re-run the stages that read it (the
    search) when this stage re-runs for a params change that does not touch the figures."""
    entry = CACHE_DIR / f"{key}.json" if key else None
    if entry is None or not entry.exists():
        return None
    try:
        hit = read_profile(entry)
        if hit.status != "profiled":
            raise QuantgateError("not a measurement")
    except (QuantgateError, OSError):
        print(f"profile[{build}]: cache entry {entry} unusable; measuring again", flush=True)
        return None
    on = f", on {hit.measured_on}'s server" if hit.measured_on else ""
    print(f"profile[{build}]: from cache {key[:12]} (measured as {hit.measured_as or hit.build}{on})", flush=True)
    if hit.build == build:  # its own figures, read back as written: the same out, so the stages after it stay done
        return hit
    return hit.model_copy(update={"build": build, "measured_as": hit.measured_as or hit.build})


def keep(key: str | None, result: BuildProfile) -> None:
    """Keep a "profiled" `result` in CACHE_DIR under `key`; unprofiled records are not kept (a server that did
    not start may start next time). A cache that cannot be written loses only the reuse: said, not raised."""
    if key is None or result.status != "profiled":
        return
    entry = CACHE_DIR / f"{key}.json"
    try:
        write_profile(entry, result)  # it makes the folder
    except OSError as exc:
        print(f"profile[{result.build}]: not kept in the cache ({entry}: {exc.strerror or exc})", flush=True)
    except QuantgateError as exc:  # write_profile's own one line (a folder in its place, a read-only folder)
        print(f"profile[{result.build}]: not kept in the cache ({exc})", flush=True)


def profile_on_evaluate_server(
    build: str, model_dir: Path, server: Server, serve: ServeParams, params: ProfileParams
) -> bool | None:
    """Measure `build` on `server`, which evaluate@<build> started with `serve` (evaluate.serve) and has not
    scored on yet, and keep the figures in CACHE_DIR for profile@<build>, which then starts no server of its
    own. Only where that stage would start the same server (`profile.cpu_cores` unset or equal) and finds no
    figures in the cache. Returns True when it measured, False when the measurement failed, None when it asked
    nothing of the server. Never raises: a failure is printed, and profile@<build> measures on its own server."""
    ours = profile_serve(serve, params)
    key = cache_key(model_dir, ours, params)
    if ours != serve or key is None or (CACHE_DIR / f"{key}.json").exists():
        return None
    record = first_record(build, model_dir, params) | {"measured_on": f"evaluate@{build}"}
    try:
        result = measure(server, model_dir, add_served(record, model_dir, ours), params, record)
    except Exception as exc:  # a failure of the profile's, whatever it is, must not fail evaluate@<build>
        why = unprofiled_reason(exc, params) if isinstance(exc, MEASURE_ERRORS) else f"{type(exc).__name__}: {exc}"
        print(
            f"profile[{build}]: not measured on evaluate's server ({why}); profile@{build} will measure it on its own",
            flush=True,
        )
        return False
    keep(key, result)
    return True
