"""Stage `evaluate@<build>`: score one build on every team's tasks through a vLLM server.

Run by DVC: `python -m pipeline.evaluate BUILD MODEL_DIR EVALS_DIR OUT_DIR` (params blocks `evaluate`, `profile`).

One server per build serves all teams, and profile@<build> too: when this stage starts it (it did not find every
team in the cache), the build is first measured there for that stage, and when profile@<build> ran first its
server scored the teams this stage then reads from the cache (pipeline/README.md, "One server per build"; params
block `profile`). lm-eval talks to it with `local-completions` on
token ids (`tokenized_requests=True`) so the chat template, tokenizer and BOS handling are
the build's own and explicit. Per team it writes OUT_DIR/<team>/scores.json (per-sample
scores the gate pairs by document) and samples.jsonl (lm-eval's per-sample log);
OUT_DIR/timing.json: seconds spent starting the server, measuring the build for profile@<build> on it
(`profile_s` when it measured, `profile_failed_s` when that failed: one server per build, pipeline/measuring.py)
and scoring each team; and
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
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.measuring import profile_on_evaluate_server
from pipeline.team_scores import (
    TIMING,
    from_cache,
    score_on,
    scoring_of,
    write_team,
)
from quantgate.console import per_build
from quantgate.credentials import drop_credentials
from quantgate.errors import QuantgateError, run_main
from quantgate.evaluate_params import EvaluateParams, check_endpoint_builds
from quantgate.executor import ExecutorParams
from quantgate.params import load_block, load_builds
from quantgate.precision import RECORD as PRECISION
from quantgate.profile_params import ProfileParams
from quantgate.results import TeamScores
from quantgate.serving import ServeParams, Server, ServerStartError, vllm_server
from quantgate.teams import load_teams

ENDPOINT = "endpoint.json"  # results/eval/<build>/endpoint.json: the remote endpoint a build was scored on


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


def evaluate(
    build: str,
    model_dir: Path,
    evals_dir: Path,
    out_dir: Path,
    params: EvaluateParams,
    executor: ExecutorParams | None = None,
    profiling: ProfileParams | None = None,
) -> dict[str, TeamScores]:
    """Evaluate `build` on every team; write OUT_DIR/<team>/; return {team: its scores}.

    With `params.endpoints[build]` the build is scored on that remote vLLM deployment, after
    check_endpoint: OUT_DIR/endpoint.json records it, no server is started here.
    With `executor.kind: ray` (and no endpoint for the build) the servers and scoring run on the Ray cluster
    (evaluate_on_ray). With `profiling` (the `profile` block; main passes it for a local run), a server started
    here first measures the build for profile@<build> (pipeline/measuring.py), before any team is scored on it.
    Raises QuantgateError on bad input (missing build, bad team folder, an endpoint that
    does not serve this build or cannot be reached, a Ray cluster that cannot run it). Server start failures
    and per-team errors are recorded in the documents, not raised.
    """
    if executor is not None and executor.kind == "ray" and build not in params.endpoints:
        from pipeline.on_ray import evaluate_on_ray

        return evaluate_on_ray(build, model_dir, evals_dir, out_dir, params, executor)
    teams = load_teams(evals_dir)
    scoring, remote = scoring_of(build, model_dir, params)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    if remote:
        (out_dir / ENDPOINT).write_text(json.dumps(remote, indent=1) + "\n")
    timing = {"build": build, "server_start_s": 0.0, "scoring_s": {}, "cached": []}
    docs, pending = from_cache(scoring, teams, out_dir, timing)
    if pending:
        started = time.monotonic()
        try:
            with scoring_server(build, model_dir, out_dir, params.serve, remote) as server:
                timing["server_start_s"] = round(time.monotonic() - started, 1)
                print(f"evaluate[{build}]: vLLM server ready at {server.base_url}", flush=True)
                measuring = time.monotonic()
                if profiling and not remote:
                    measured = profile_on_evaluate_server(build, model_dir, server, params.serve, profiling)
                    if measured is not None:  # a failed measurement's seconds are spent too
                        timing["profile_s" if measured else "profile_failed_s"] = round(time.monotonic() - measuring, 1)
                told = False  # the server's death, printed once
                for team, scores in score_on(server, scoring, pending, out_dir, timing, f"evaluate[{build}]"):
                    docs[team.name] = scores
                    if scores.status == "ok":  # ok teams are summed up once, at the end
                        continue
                    if told:
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
    (out_dir / PRECISION).write_text(json.dumps(scoring.precision, indent=1) + "\n")
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
    profiling = load_block("profile", ProfileParams) if executor.kind == "local" else None
    docs = evaluate(build, model_dir, evals_dir, out_dir, params, executor, profiling)
    for team, scores in sorted(docs.items()):
        if scores.status == "ok":
            summary = ", ".join(f"{t}={v.score:.3f} (n={v.n})" for t, v in scores.tasks.items())
        else:  # the reason was printed when it happened (one server failure fails every team)
            summary = "ERROR (reason above)"
        print(f"evaluate[{build}]: {team:<12} {summary}")


if __name__ == "__main__":
    run_main(main, log=per_build("evaluate"))
