"""Stage `profile@<build>`: what one build costs to hold and how fast it serves, on the serving engine.

Run by DVC: `python -m pipeline.profile BUILD MODEL_DIR OUT_JSON` (params blocks `profile`, `evaluate.serve`).

The build is started in a vLLM OpenAI server exactly as the evaluate stage serves it (quantgate/serving.py:
same serving env, precision, max_model_len, KV-cache size and the build's own kv_cache_dtype). From vLLM's
start-up report it records the weights memory, the KV-cache capacity in tokens and the most concurrent
requests of max_model_len tokens that fit; beside vLLM's KV figure, the arithmetic one (quantgate/cost.py:
2 x layers x KV heads x head dim x bytes per element, from the build's config.json; CPU, where the KV
space is evaluate.serve.kv_cache_gib). Then vLLM's own serving benchmark (`vllm bench serve`, through
quantgate/loadgen.py, the code benchmarks/serving.py runs) at each of `profile.concurrency`: output
tokens/s and TTFT/TPOT p50/p99 on a fixed random prompt set (`profile.seed`).

A build that cannot be served here (W4A16 on an AVX2-only CPU, an FP8 KV cache without AVX-512, a server
that does not start or dies (quantgate.serving.Server.death: how long after it was ready, exit code or
signal, the log's last error line), a benchmark that fails) gets a record with status "unprofiled" and
the one-line reason; the stage still succeeds, so the rest of `dvc repro` runs. The gate then does not recommend that
build; its quality verdict is the evaluate stage's business. The server's log is
results/logs/profile@<build>.server.log (no DVC output).

A build's figures are kept by content in `.quantgate/cache/profile/<key>.json` (cache_key: weights,
config, serving settings as resolved, serving env and machine, load; not the build's name), so a build
with the weights of one measured before is not served again: its record says which build it was measured
as (`measured_as`). Delete the folder to measure anew.

With `executor.kind: ray` (quantgate/executor.py) the server and the benchmark run as one Ray task on a node
with the executor's resources, the hardware that will serve (profile_on_ray); the record is written here
and names the node (`placement`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from quantgate.console import per_build
from quantgate.cost import KVShape, kv_bytes_per_token, kv_capacity_tokens, kv_dtype_bytes
from quantgate.errors import QuantgateError, project_relative, run_main
from quantgate.executor import ExecutorParams, connect
from quantgate.hashing import digest_json
from quantgate.loadgen import Load, bench, disk_mib, startup_report, tree_rss_gib
from quantgate.manifest import config_digest, read_manifest
from quantgate.params import load_block
from quantgate.precision import probe, probe_key
from quantgate.profile_params import ProfileParams
from quantgate.remote import node_python, on_node, published, settle, submit
from quantgate.results import BuildProfile, LoadPoint, Placement, read_profile, write_profile
from quantgate.serving import BEFORE_SERVER, ServeParams, kv_cache_dtype, refusal_head, resolved, vllm_server

LOGS = Path("results/logs")
CACHE_DIR = Path(".quantgate/cache/profile")
# bump when what a profile measures or records changes (this module, quantgate/loadgen.py): older entries then miss
CODE_VERSION = 1


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
    """One benchmark result (vLLM's result JSON, quantgate.loadgen.bench) as a LoadPoint, rounded for reading."""
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


def profile(build: str, model_dir: Path, serve: ServeParams, params: ProfileParams) -> BuildProfile:
    """Serve `build` from `model_dir` and measure it (module docstring); return its BuildProfile.

    Never raises for a build that cannot be served or measured: that is an "unprofiled" record with the
    reason (paths relative to the project). Raises QuantgateError only for a missing build directory.
    """
    if not (model_dir / "config.json").is_file():
        raise QuantgateError(f"{model_dir}/config.json not found: run `dvc repro` (prepare / quantize make the build)")
    if params.cpu_cores:
        serve = serve.model_copy(update={"cpu_cores": params.cpu_cores})
    record = {
        "build": build,
        "input_len": params.input_len,
        "output_len": params.output_len,
        "seed": params.seed,
        "weights_mib": disk_mib(model_dir),
    }
    load = Load(params.input_len, params.output_len, params.seed, params.timeout_s)
    try:
        kv_dtype = record["kv_cache_dtype"] = kv_cache_dtype(model_dir)
        serve = resolved(serve, model_dir)  # dtype, eager mode and the KV space as the server gets them
        record["dtype"] = serve.dtype
        record |= arithmetic_kv(model_dir, serve, kv_dtype, probe(serve.python).is_cpu)
        LOGS.mkdir(parents=True, exist_ok=True)
        with (
            tempfile.TemporaryDirectory(prefix="profile-") as tmp,
            vllm_server(serve, model_dir.resolve(), build, LOGS / f"profile@{build}.server.log") as server,
            server.deaths(),  # a server that dies under the benchmark: its death is the reason
        ):
            facts = startup_report(server.log_path.read_text(errors="replace"))
            record |= {
                "kv_tokens": facts.kv_tokens,
                "max_concurrency": facts.max_concurrency,
                "max_concurrency_at": facts.max_concurrency_at,
                "weights_gib": facts.weights_gib,
                "weights_source": facts.weights_source,
                "server_rss_gib": tree_rss_gib(server.pid),
            }
            arithmetic = record["kv_tokens_arithmetic"]
            print(f"profile[{build}]: vLLM reports {facts.kv_tokens} KV tokens (arithmetic: {arithmetic})", flush=True)
            loads = {}
            for c in params.concurrency:
                n = max(params.prompts_per_concurrency, c)
                r = bench(serve.python, server.base_url, build, model_dir.resolve(), c, n, load, Path(tmp))
                loads[f"c{c}"] = p = load_point(c, n, r)
                print(
                    f"profile[{build}]: C={c}: {p.output_tokens_per_s:.1f} tok/s, TTFT p50 {p.ttft_ms_p50:.0f} ms, "
                    f"TPOT p50 {p.tpot_ms_p50:.0f} ms",
                    flush=True,
                )
        return BuildProfile(status="profiled", loads=loads, **record)
    except (QuantgateError, subprocess.TimeoutExpired, OSError, ValueError) as exc:
        reason = project_relative((str(exc).strip() or type(exc).__name__).split(" (log: ")[0].splitlines()[0])
        if isinstance(exc, subprocess.TimeoutExpired):
            reason = f"vllm bench serve took longer than profile.timeout_s ({params.timeout_s} s)"
        return BuildProfile(status="unprofiled", reason=reason, **record)


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


def measured(build: str, model_dir: Path, serve: ServeParams, params: ProfileParams) -> BuildProfile:
    """profile(), through the content cache CACHE_DIR/<cache_key>.json: a build whose figures were measured
    before (under another name, or an earlier run) gets them again, marked `measured_as`; a new "profiled"
    record is kept there. Unprofiled records are not kept (a server that did not start may start next time).
    Raises QuantgateError as profile()."""
    key = cache_key(model_dir, serve, params)
    cached = CACHE_DIR / f"{key}.json" if key else None
    if cached is not None and cached.exists():
        try:
            hit = read_profile(cached)
            if hit.status != "profiled":
                raise QuantgateError("not a measurement")
            print(f"profile[{build}]: from cache {key[:12]} (measured as {hit.measured_as or hit.build})", flush=True)
            return hit.model_copy(update={"build": build, "measured_as": hit.measured_as or hit.build})
        except (QuantgateError, OSError):  # unreadable, or not a measurement: measure again, replace it below
            print(f"profile[{build}]: cache entry {cached} unusable; measuring again", flush=True)
    result = profile(build, model_dir, serve, params)
    if cached is not None and result.status == "profiled":
        try:
            write_profile(cached, result)  # it makes the folder
        except OSError as exc:  # the measurement stands; only its reuse is lost
            print(f"profile[{build}]: not kept in the cache ({cached}: {exc.strerror or exc})", flush=True)
        except QuantgateError as exc:  # write_profile's own one line (a folder in its place, a read-only folder)
            print(f"profile[{build}]: not kept in the cache ({exc})", flush=True)
    return result


LOG_TAIL = 200_000  # bytes of the server log a Ray task sends back


def profile_task(request: dict) -> dict:
    """Run on a Ray node (executor.kind: ray): fetch the build, profile it there with the node's serving env;
    return {"node", "profile" (BuildProfile as JSON), "log" (the server log's tail)}. Raises QuantgateError
    naming the node for a build it cannot fetch (an unservable build is an "unprofiled" record, as here)."""
    with on_node(request) as (node, model_dir, _):
        serve = ServeParams.model_validate(request["serve"])
        serve = serve.model_copy(update={"python": node_python(serve.python)})
        result = profile(request["build"], model_dir, serve, ProfileParams.model_validate(request["params"]))
        log = LOGS / f"profile@{request['build']}.server.log"  # under the task's scratch folder
        tail = log.read_bytes()[-LOG_TAIL:].decode(errors="replace") if log.exists() else ""
        return {"node": node, "profile": result.dump(), "log": tail}


def profile_on_ray(
    build: str, model_dir: Path, serve: ServeParams, params: ProfileParams, executor: ExecutorParams
) -> BuildProfile:
    """Profile `build` on a node of the Ray cluster that has the executor's resources (the hardware that will
    serve it): the build is published to the store and fetched there. Returns its BuildProfile with the
    placement; a node that dies, or cannot fetch the build, makes it "unprofiled" with that reason. Raises
    QuantgateError (one line, before any server starts) for a cluster that does not answer or lacks them."""
    connect(executor)
    request = {
        "build": build,
        **published(model_dir, executor),
        "serve": serve.model_dump(mode="json"),
        "params": params.model_dump(mode="json"),
    }
    ((reply, why),) = settle([submit(profile_task, request, executor)], executor)
    if reply is None:
        lengths = {"input_len": params.input_len, "output_len": params.output_len, "seed": params.seed}
        return BuildProfile(build=build, status="unprofiled", reason=why, **lengths)
    LOGS.mkdir(parents=True, exist_ok=True)
    (LOGS / f"profile@{build}.server.log").write_text(reply["log"])
    node = reply["node"]
    where = Placement(executor="ray", host=node["host"], node_id=node["node_id"], ip=node["ip"])
    return BuildProfile.model_validate(reply["profile"]).model_copy(update={"placement": where})


def main() -> None:
    if len(sys.argv) != 4:
        raise QuantgateError("usage: python -m pipeline.profile BUILD MODEL_DIR OUT_JSON")
    build, model_dir, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    params = load_block("profile", ProfileParams)
    serve = load_block("evaluate.serve", ServeParams)
    executor = load_block("executor", ExecutorParams)
    if executor.kind == "ray":
        result = profile_on_ray(build, model_dir, serve, params, executor)
    else:
        result = measured(build, model_dir, serve, params)
    write_profile(out, result)
    why = f": {result.reason}" if result.reason else ""  # the reason once (main prints it for every executor)
    wrote = f"wrote {out}"
    if head := refusal_head(result.reason or ""):  # a refusal evaluate prints whole: its head here, the rest in OUT
        why, wrote = f": {head} {BEFORE_SERVER}", f"wrote {out} with the whole reason"
    print(f"profile[{build}]: {result.status}{why}; {wrote}", file=sys.stderr if why else sys.stdout, flush=True)


if __name__ == "__main__":
    run_main(main, log=per_build("profile"))
