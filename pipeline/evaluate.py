"""Stage `evaluate@<build>`: score one build on every team's tasks through a vLLM server.

Run by DVC: `python -m pipeline.evaluate BUILD MODEL_DIR EVALS_DIR OUT_DIR` (params block `evaluate`).

One server per build serves all teams. lm-eval talks to it with `local-completions` on
token ids (`tokenized_requests=True`) so the chat template, tokenizer and BOS handling are
the build's own and explicit. Per team it writes OUT_DIR/<team>/scores.json (per-sample
scores the gate pairs by document) and samples.jsonl (lm-eval's per-sample log);
OUT_DIR/timing.json: seconds spent starting the server vs scoring each team; and
OUT_DIR/precision.json: the activation dtype the build was served at and why
(`evaluate.serve.dtype: auto` is resolved by one rule, quantgate/precision.py, so every build of
a run gets the same precision and the gate compares builds, not dtypes).

Results are cached by content in `.quantgate/cache/eval/<key>/`, key = sha256 of (weights
digest, digest of the build's other files (config, tokenizer, chat template), digest of the
team's task YAMLs and data files, the team's metric, harness config, serving config): a
changed eval set re-runs that team only, a changed build that build only, and a change of a
team's margin, confidence or contact nothing (the gate re-judges the cached scores). lm-eval's
own request cache is never used (it is keyed by request, not by model). A team whose run
errors, or a server that does not start, is recorded as status "error" with a one-line reason
(never cached); the gate fails it closed. A server that dies while it is scoring (quantgate's
own, not a remote endpoint) gets no more requests: the team being scored and every team after it
are errors whose reason is the death (quantgate.serving.Server.death: build, seconds, exit code
or signal, the log's last error line), not the refused connections that follow it.

Team files are input from outside the pipeline: lm-eval renders their templates in the
sandbox of quantgate/sandbox.py, and the stage runs without registry and cloud credentials in its
environment (`drop_credentials`; the vLLM server it starts inherits that environment).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

from quantgate.console import per_build, progress
from quantgate.credentials import drop_credentials
from quantgate.errors import QuantgateError, run_main
from quantgate.evaluate_params import EvaluateParams, check_endpoint_builds
from quantgate.executor import ExecutorParams
from quantgate.hashing import digest_json
from quantgate.manifest import config_digest, verify_weights
from quantgate.params import PARAMS_FILE, load_block, load_builds, where
from quantgate.precision import RECORD as PRECISION
from quantgate.precision import precision_record
from quantgate.results import SAMPLES, SCORES, Placement, ServingRecord, TeamScores, read_scores, write_scores
from quantgate.scoring import HarnessParams, effective_limit, run_team
from quantgate.serving import (
    ServeParams,
    Server,
    ServerDied,
    ServerStartError,
    check_endpoint,
    runtime_record,
    served_max_model_len,
    serves_w4a8,
    serving_versions,
    vllm_server,
)
from quantgate.teams import Team, load_teams

CACHE_DIR = Path(".quantgate/cache/eval")
TIMING = "timing.json"  # per build: server start vs scoring seconds (benchmarks/pipeline_cost.py reads it)


ENDPOINT = "endpoint.json"  # results/eval/<build>/endpoint.json: the remote endpoint a build was scored on


def cache_key(weights_digest: str, team: Team, harness: HarnessParams, serve_config: dict, model_files: str) -> str:
    """Content key of one (build, team) evaluation.

    Inputs that change scores are in it: weights, the build's config/tokenizer files
    (`model_files`, quantgate.manifest.config_digest), the team's task YAMLs and data files
    (Team.scores_digest) and the metric its scores document holds, the lm-eval version and
    harness settings (limit, BOS, chat template), the serving engine versions and flags.
    Concurrency and retries are not: they do not change scores; nor is the rest of the team's
    policy (margin, confidence, owner, contact): the gate applies it to the cached scores.
    """
    return digest_json(
        {
            "weights": weights_digest,
            "model_files": model_files,
            "team": team.scores_digest,
            "metric": team.policy.metric,
            "harness": {
                "lm_eval": metadata.version("lm_eval"),
                "limit": effective_limit(team, harness),
                "add_bos_token": harness.add_bos_token,
                "seed": harness.seed,
                "chat_template": team.policy.chat_template,
                "tokenized_requests": True,
            },
            "serving": serve_config,
        }
    )


def make_lm(server, model_dir: Path, harness: HarnessParams, max_length: int):
    """lm-eval's local-completions client for `server`, tokenizing with the build's tokenizer.

    `max_length` (tokens) is the server's max_model_len: lm-eval cuts prompts to it (its own
    default is 2048 whatever the server takes), and run_team refuses prompts that get cut; -1 (vLLM fit it
    at start) is read from the server (served_max_model_len). Raises QuantgateError if it cannot be.
    """
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    if max_length == -1:
        max_length = served_max_model_len(server)

    return LocalCompletionsAPI(
        base_url=f"{server.base_url}/completions",
        model=server.name,
        tokenizer=str(model_dir),
        tokenizer_backend="huggingface",
        tokenized_requests=True,
        add_bos_token=harness.add_bos_token,
        num_concurrent=harness.num_concurrent,
        max_retries=harness.max_retries,
        batch_size=harness.batch_size,
        seed=harness.seed,
        max_length=max_length,
    )


def write_team(out: Path, scores: TeamScores, raw: list[dict] | None) -> None:
    """Write one team's scores.json and, when there are any, lm-eval's raw samples."""
    write_scores(out, scores)
    if raw is not None:
        with open(out / SAMPLES, "w") as f:
            for s in raw:
                f.write(json.dumps(s, default=str) + "\n")


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and first line of message."""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return msg if isinstance(exc, QuantgateError) else f"{type(exc).__name__}: {msg}"


def serving_config(
    build: str, model_dir: Path, weights_digest: str, params: EvaluateParams
) -> tuple[dict, ServingRecord, dict | None]:
    """(precision record, serving record, remote endpoint evidence or None) of `build`.

    Local: the run's precision rule and the `auto` serving values resolved here (quantgate/precision.py).
    Remote (`params.endpoints[build]`): check_endpoint first, so a wrong build is refused before
    anything is scored or read from the cache; the dtype is the one the endpoint entry declares.
    Raises QuantgateError (serving env unusable, GPU missing, endpoint refused or unreachable).
    """
    endpoint = params.endpoints.get(build)
    if endpoint is None:
        precision = precision_record(params.serve.python, params.serve.dtype)  # one rule for every build of a run
        precision.update(runtime_record(params.serve, model_dir))
        serving = ServingRecord(
            versions=serving_versions(params.serve.python),
            dtype=precision["dtype"],
            max_model_len=params.serve.max_model_len,
            extra_args=params.serve.extra_args,
        )
        return precision, serving, None
    if serves_w4a8(model_dir):  # fail closed: what the deployment computes could not be known
        raise QuantgateError(
            f"{where(PARAMS_FILE, f'evaluate.endpoints.{build}')}: evaluate.endpoints.{build}: {build} is served as "
            "W4A8 (w4a8 in its build.json), which cannot be checked on a deployment (vLLM publishes neither "
            "VLLM_CPU_INT4_W4A8 nor the kernel it runs); drop this entry to score it on a local or Ray server"
        )
    remote = check_endpoint(build, weights_digest, endpoint, os.environ.get("OPENAI_API_KEY", ""))
    print(f"evaluate[{build}]: {endpoint.url} serves {remote['served']} (vLLM {remote['vllm']})", flush=True)
    precision = {
        "dtype": endpoint.dtype,
        "requested": endpoint.dtype,
        "why": f"remote endpoint: evaluate.endpoints.{build}.dtype (the deployment's --dtype)",
        "device": "remote",
        "endpoint": endpoint.url,
    }
    serving = ServingRecord(
        versions={"vllm": remote["vllm"]},
        dtype=endpoint.dtype,
        max_model_len=remote["max_model_len"] or params.serve.max_model_len,
        extra_args=[],
        endpoint=endpoint.url,
    )
    return precision, serving, remote


@contextmanager
def scoring_server(
    build: str, model_dir: Path, out_dir: Path, serve: ServeParams, remote: dict | None
) -> Iterator[Server]:
    """The server a build is scored on: the checked remote endpoint (`remote`, from check_endpoint),
    else a vLLM server started here for the block (its log: OUT_DIR/server.log)."""
    if remote:
        yield Server(base_url=remote["url"], name=remote["served"], log_path=out_dir / ENDPOINT)
        return
    with vllm_server(serve, model_dir.resolve(), build, out_dir / "server.log") as server:
        yield server


def score_teams(
    server: Server, lm, items: list[tuple[Team, dict[str, list[int]] | None]], harness: HarnessParams
) -> Iterator[tuple[int, TeamScores, list[dict] | None, float | None]]:
    """Score each (team, documents or None for all) of `items` on `server` in turn; yield (index, its scores,
    lm-eval's raw samples or None, scoring seconds or None when it was not scored).

    A team's failure is its own (status "error", one line) and the next team is scored. A server that dies
    gets no more requests: the team being scored and every team after it are errors whose reason is the
    death (quantgate.serving.Server.death), not the refused connections that follow it.
    """
    dead = None
    for i, (team, docs) in enumerate(items):
        dead = dead or server.death()
        if dead:
            yield i, TeamScores(status="error", reason=dead), None, None
            continue
        started = time.monotonic()
        try:
            with server.deaths():
                scores, raw = run_team(lm, team, harness) if docs is None else run_team(lm, team, harness, docs)
        except ServerDied as exc:  # the team being scored when it died
            dead = str(exc)
            scores, raw = TeamScores(status="error", reason=dead), None
        except Exception as exc:  # one team's failure must not lose the others
            scores, raw = TeamScores(status="error", reason=one_line(exc)), None
        yield i, scores, raw, round(time.monotonic() - started, 1)


def stamped(scores: TeamScores, team: Team, build: str, key: str, manifest: dict, serving: ServingRecord) -> TeamScores:
    """`scores` with what it was scored for: the team, build, cache key, digests and serving record."""
    return scores.model_copy(
        update={
            "team": team.name,
            "build": build,
            "cache_key": key,
            "weights_digest": manifest["weights_digest"],
            "scores_digest": team.scores_digest,
            "serving": serving,
        }
    )


def local_placement(
    precision: dict, serving: ServingRecord, executor: str = "local", node: dict | None = None
) -> Placement:
    """Where a team is scored: this machine (or the Ray node `node`: node_id, ip, host), its device and
    machine kind from the precision record, the serving vLLM version."""
    node = node or {"host": socket.gethostname()}
    return Placement(
        executor=executor,
        host=node["host"],
        node_id=node.get("node_id"),
        ip=node.get("ip"),
        device=precision.get("device"),
        machine_kind=precision.get("machine_kind"),
        vllm=serving.versions.get("vllm"),
    )


def from_cache(
    build: str,
    teams: list[Team],
    manifest: dict,
    model_files: str,
    serving: ServingRecord,
    harness: HarnessParams,
    out_dir: Path,
    timing: dict,
) -> tuple[dict[str, TeamScores], list[tuple[Team, str]]]:
    """Copy every team already scored for this build and serving record from CACHE_DIR into OUT_DIR/<team>/.

    Returns ({team: its cached scores}, [(team, cache key) still to score]); appends the cached teams'
    names to `timing["cached"]`. The key (cache_key) includes the build's serving settings (its KV cache
    dtype, W4A8) through `model_files` (quantgate.manifest.config_digest): they change what the build computes.
    """
    serve_config = serving.dump()
    docs, pending = {}, []
    for team in teams:
        key = cache_key(manifest["weights_digest"], team, harness, serve_config, model_files)
        cached = CACHE_DIR / key
        if (cached / SCORES).is_file():
            shutil.copytree(cached, out_dir / team.name)
            docs[team.name] = read_scores(cached / SCORES)
            timing["cached"].append(team.name)
            print(f"evaluate[{build}]: {team.name}: from cache {key[:12]}", flush=True)
        else:
            pending.append((team, key))
    return docs, pending


def evaluate(
    build: str,
    model_dir: Path,
    evals_dir: Path,
    out_dir: Path,
    params: EvaluateParams,
    executor: ExecutorParams | None = None,
) -> dict[str, TeamScores]:
    """Evaluate `build` on every team; write OUT_DIR/<team>/; return {team: its scores}.

    With `params.endpoints[build]` the build is scored on that remote vLLM deployment, after
    check_endpoint: OUT_DIR/endpoint.json records it, no server is started here.
    With `executor.kind: ray` (and no endpoint for the build) the servers and scoring run on the Ray cluster
    (evaluate_on_ray). Raises QuantgateError on bad input (missing build, bad team folder, an endpoint that
    does not serve this build or cannot be reached, a Ray cluster that cannot run it). Server start failures
    and per-team errors are recorded in the documents, not raised.
    """
    if executor is not None and executor.kind == "ray" and build not in params.endpoints:
        from pipeline.on_ray import evaluate_on_ray

        return evaluate_on_ray(build, model_dir, evals_dir, out_dir, params, executor)
    manifest = verify_weights(model_dir)
    model_files = config_digest(model_dir)
    teams = load_teams(evals_dir)
    precision, serving, remote = serving_config(build, model_dir, manifest["weights_digest"], params)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    if remote:
        (out_dir / ENDPOINT).write_text(json.dumps(remote, indent=1) + "\n")
    timing = {"build": build, "server_start_s": 0.0, "scoring_s": {}, "cached": []}
    docs, pending = from_cache(build, teams, manifest, model_files, serving, params.harness, out_dir, timing)
    if pending:
        started = time.monotonic()
        try:
            with scoring_server(build, model_dir, out_dir, params.serve, remote) as server:
                timing["server_start_s"] = round(time.monotonic() - started, 1)
                print(f"evaluate[{build}]: vLLM server ready at {server.base_url}", flush=True)
                lm = make_lm(server, model_dir.resolve(), params.harness, serving.max_model_len)
                here = local_placement(precision, serving)
                told = False  # the server's death, printed once
                scored = score_teams(server, lm, [(team, None) for team, _ in pending], params.harness)
                for i, scores, raw, seconds in progress(
                    scored, desc=f"evaluate[{build}]: scoring", unit="team", total=len(pending)
                ):
                    team, key = pending[i]
                    if seconds is not None:
                        timing["scoring_s"][team.name] = seconds
                    if scores.status == "ok":
                        scores = scores.model_copy(update={"placement": [here]})
                    docs[team.name] = scores = stamped(scores, team, build, key, manifest, serving)
                    write_team(out_dir / team.name, scores, raw)
                    if scores.status == "ok":  # ok teams are summed up once, at the end
                        shutil.copytree(out_dir / team.name, CACHE_DIR / key, dirs_exist_ok=True)
                    elif told:
                        print(f"evaluate[{build}]: {team.name}: error, not scored: its server died", flush=True)
                    else:
                        print(f"evaluate[{build}]: {team.name}: {scores.status} {scores.reason or ''}", flush=True)
                        told = scores.reason == server.death()
        except ServerStartError as exc:
            for team, key in pending:
                if team.name not in docs:
                    docs[team.name] = scores = TeamScores(
                        team=team.name, build=build, cache_key=key, status="error", reason=str(exc)
                    )
                    write_team(out_dir / team.name, scores, None)
            timing["server_start_s"] = round(time.monotonic() - started, 1)
            print(f"evaluate[{build}]: not served: {exc}", file=sys.stderr, flush=True)
    (out_dir / TIMING).write_text(json.dumps(timing, indent=1) + "\n")
    (out_dir / PRECISION).write_text(json.dumps(precision, indent=1) + "\n")
    return docs


def main() -> None:
    if len(sys.argv) != 5:
        raise QuantgateError("usage: python -m pipeline.evaluate BUILD MODEL_DIR EVALS_DIR OUT_DIR")
    build, model_dir, evals_dir, out_dir = sys.argv[1], *map(Path, sys.argv[2:])
    params = load_block("evaluate", EvaluateParams)
    executor = load_block("executor", ExecutorParams)
    # least privilege: team templates are rendered where lm-eval runs. On Ray that is the nodes, which drop
    # credentials themselves after fetching the build; here the stage keeps the store's, to publish it.
    if executor.kind == "local" and (gone := drop_credentials(os.environ)):
        logging.getLogger(__name__).info("running without %s", ", ".join(gone))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    check_endpoint_builds(params, load_builds())
    docs = evaluate(build, model_dir, evals_dir, out_dir, params, executor)
    for team, scores in sorted(docs.items()):
        if scores.status == "ok":
            summary = ", ".join(f"{t}={v.score:.3f} (n={v.n})" for t, v in scores.tasks.items())
        else:  # the reason was printed when it happened (one server failure fails every team)
            summary = "ERROR (reason above)"
        print(f"evaluate[{build}]: {team:<12} {summary}")


if __name__ == "__main__":
    run_main(main, log=per_build("evaluate"))
