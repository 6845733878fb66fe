"""Stage `profile@<build>`: what one build costs to hold and how fast it serves, on the serving engine.

Run by DVC: `python -m pipeline.profile BUILD MODEL_DIR EVALS_DIR OUT_JSON` (params blocks `profile`, `evaluate`).

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
results/logs/profile@<build>.server.log, and a local run's seconds (server start, measurement, each team scored
for evaluate@<build>) results/logs/profile@<build>.timing.json (no DVC outputs).

A build's figures are kept by content in `.quantgate/cache/profile/<key>.json` (cache_key: weights,
config, serving settings as resolved, serving env and machine, load; not the build's name), so a build
with the weights of one measured before is not served again: its record says which build it was measured
as (`measured_as`). Delete the folder to measure anew.

One server per build (pipeline/measuring.py, pipeline/team_scores.py): a local server started here, once the
build is measured, scores the teams of EVALS_DIR that evaluate@<build> finds not in its cache, and keeps them
there; a server evaluate@<build> starts first measures the build for this stage (`measured_on` names it), before
any team is scored on it. Whichever of the two stages DVC runs first starts the build's one server; the other
reads the cache. A failure on the shared server is left to the other stage, which then starts its own.

With `executor.kind: ray` (quantgate/executor.py) the server and the benchmark run as one Ray task on a node
with the executor's resources, the hardware that will serve (profile_on_ray); the record is written here
and names the node (`placement`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.measuring import (
    MEASURE_ERRORS,
    add_served,
    cache_key,
    cached,
    first_record,
    keep,
    measure,
    profile_serve,
    unprofiled_reason,
)
from pipeline.team_scores import score_for_evaluate
from quantgate.console import per_build
from quantgate.credentials import drop_credentials
from quantgate.errors import QuantgateError, run_main
from quantgate.evaluate_params import EvaluateParams
from quantgate.executor import ExecutorParams, connect
from quantgate.params import load_block
from quantgate.profile_params import ProfileParams
from quantgate.remote import node_python, on_node, published, settle, submit
from quantgate.results import BuildProfile, Placement, write_profile
from quantgate.serving import BEFORE_SERVER, ServeParams, Server, refusal_head, vllm_server

LOGS = Path("results/logs")


def profile(
    build: str, model_dir: Path, serve: ServeParams, params: ProfileParams, after=None, timing: dict | None = None
) -> BuildProfile:
    """Serve `build` from `model_dir` and measure it (module docstring); return its BuildProfile. `after(server,
    result)` then runs on the same server, once the build is measured (measured(): the figures kept, then the teams
    scored there for evaluate@<build>). `timing`, where given, gets the seconds the server took to be ready
    (`server_start_s`; for a server that did not start, the seconds until it failed) and the measurement took
    (`profile_s` when it succeeded, `profile_failed_s` when it failed).

    Never raises for a build that cannot be served or measured: that is an "unprofiled" record with the
    reason (paths relative to the project). Raises QuantgateError only for a missing build directory.
    """
    if not (model_dir / "config.json").is_file():
        raise QuantgateError(f"{model_dir}/config.json not found: run `dvc repro` (prepare / quantize make the build)")
    serve = profile_serve(serve, params)
    record = first_record(build, model_dir, params)
    result = started = ready = None
    try:
        serve = add_served(record, model_dir, serve)
        LOGS.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with vllm_server(serve, model_dir.resolve(), build, LOGS / f"profile@{build}.server.log") as server:
            ready = time.monotonic()
            if timing is not None:  # a server that started and then fails the measurement still cost its start
                timing["server_start_s"] = round(ready - started, 1)
            try:
                result = measure(server, model_dir, serve, params, record)
            finally:  # a failed measurement (up to profile.timeout_s) is time spent too
                if timing is not None:
                    spent = round(time.monotonic() - ready, 1)
                    timing["profile_s" if result is not None else "profile_failed_s"] = spent
            if after is not None:
                after(server, result)
        return result
    except MEASURE_ERRORS as exc:
        if timing is not None and started is not None and ready is None:  # as evaluate records a failed start
            timing["server_start_s"] = round(time.monotonic() - started, 1)
        if result is not None:  # measured (and kept by measured()): what failed after it is not the figures'
            print(f"profile[{build}]: after the measurement: {unprofiled_reason(exc, params)}", flush=True)
            return result
        return BuildProfile(status="unprofiled", reason=unprofiled_reason(exc, params), **record)


def measured(
    build: str, model_dir: Path, serve: ServeParams, params: ProfileParams, alongside=None, timing: dict | None = None
) -> BuildProfile:
    """profile(), through the content cache (pipeline/measuring.py CACHE_DIR/<cache_key>.json): a build whose
    figures were measured before (in an earlier run, on evaluate@<build>'s server: `measured_on`, or under another
    build's name: marked `measured_as` that build) gets them again, and no server is started (nor `alongside`
    run); a new "profiled" record is kept there as soon as it is measured, before `alongside(server)` scores the
    teams for evaluate@<build> on the same server (a stop while they are scored costs only their scores). Not
    where `profile.cpu_cores` makes this server another than evaluate's (`serve`, evaluate.serve). `timing`: as
    profile(). Raises QuantgateError as profile()."""
    ours = profile_serve(serve, params)
    key = cache_key(model_dir, ours, params)
    if (hit := cached(build, key)) is not None:
        return hit
    if alongside is not None and ours != serve:  # other cores: not evaluate's server
        print(f"profile[{build}]: profile.cpu_cores is not evaluate.serve's: no team scored here", flush=True)
        alongside = None
    kept = []

    def after(server: Server, result: BuildProfile) -> None:
        keep(key, result)
        kept.append(result)
        if alongside is not None:
            alongside(server)

    result = profile(build, model_dir, serve, params, after, timing)
    if not kept:
        keep(key, result)
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


def teams_alongside(build: str, model_dir: Path, evals_dir: Path, timing: dict) -> Callable[[Server], None] | None:
    """What runs on the profiled server after the measurement, for a local run: scoring the teams for
    evaluate@<build> (pipeline/team_scores.py score_for_evaluate; each team's seconds in `timing["scoring_s"]`),
    with the evaluate stage's environment (no registry or cloud credentials where team templates are rendered;
    Hugging Face offline). None for a build that evaluate scores on an endpoint (evaluate.endpoints). Raises
    QuantgateError for a bad `evaluate` block or an EVALS_DIR that is not a folder, before any server starts."""
    params = load_block("evaluate", EvaluateParams)
    if build in params.endpoints:
        return None
    if not evals_dir.is_dir():
        raise QuantgateError(f"{evals_dir}: not a folder of team eval sets; give the evals folder (dvc.yaml: evals)")
    if gone := drop_credentials(os.environ):  # as evaluate's main: the server and lm-eval run without them
        logging.getLogger(__name__).info("running without %s", ", ".join(gone))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return lambda server: score_for_evaluate(server, build, model_dir, evals_dir, params, timing)


def main() -> None:
    if len(sys.argv) != 5:
        raise QuantgateError("usage: python -m pipeline.profile BUILD MODEL_DIR EVALS_DIR OUT_JSON")
    build, model_dir, evals_dir, out = sys.argv[1], *map(Path, sys.argv[2:])
    params = load_block("profile", ProfileParams)
    serve = load_block("evaluate.serve", ServeParams)
    executor = load_block("executor", ExecutorParams)
    if executor.kind == "ray":  # no timing on Ray: none either from an earlier local run (benchmarks read it)
        (LOGS / f"profile@{build}.timing.json").unlink(missing_ok=True)
        result = profile_on_ray(build, model_dir, serve, params, executor)
    else:
        timing = {"build": build, "server_start_s": 0.0, "profile_s": None, "scoring_s": {}}
        alongside = teams_alongside(build, model_dir, evals_dir, timing)
        result = measured(build, model_dir, serve, params, alongside, timing)
        LOGS.mkdir(parents=True, exist_ok=True)  # beside the stage's logs: no DVC output (benchmarks read it)
        (LOGS / f"profile@{build}.timing.json").write_text(json.dumps(timing, indent=1) + "\n")
    write_profile(out, result)
    why = f": {result.reason}" if result.reason else ""  # the reason once (main prints it for every executor)
    wrote = f"wrote {out}"
    if head := refusal_head(result.reason or ""):  # a refusal evaluate prints whole: its head here, the rest in OUT
        why, wrote = f": {head} {BEFORE_SERVER}", f"wrote {out} with the whole reason"
    print(f"profile[{build}]: {result.status}{why}; {wrote}", file=sys.stderr if why else sys.stdout, flush=True)


if __name__ == "__main__":
    run_main(main, log=per_build("profile"))
