"""Scoring teams on a vLLM server through the content cache of their scores: the evaluate stage's work.

A private helper of evaluate@<build> (pipeline/evaluate.py, and pipeline/on_ray.py for a Ray cluster) and of
profile@<build> (pipeline/profile.py). The profile stage, once it has measured a build on the server it started,
scores there every team evaluate@<build> would score and finds not in the cache (`score_for_evaluate`), so that
stage starts no server of its own: one server per build instead of two, each start being three Python processes
importing vLLM in turn (benchmarks/README.md: 33-47 s on 2 cores). The scores are the same as evaluate's own:
the same build, serving settings (evaluate.serve: not where `profile.cpu_cores` differs from it), harness
and cache key, with the placement recorded. Only "ok" teams are kept: a failure on that server is left to
evaluate@<build>, which scores the team again on its own server and records its error there.

Results are cached by content in `.quantgate/cache/eval/<key>/` (cache_key).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from quantgate.console import progress
from quantgate.errors import QuantgateError
from quantgate.evaluate_params import EvaluateParams
from quantgate.hashing import digest_json
from quantgate.manifest import config_digest, verify_weights
from quantgate.params import PARAMS_FILE, where
from quantgate.precision import precision_record
from quantgate.results import SAMPLES, SCORES, Placement, ServingRecord, TeamScores, read_scores, write_scores
from quantgate.scoring import HarnessParams, effective_limit, run_team
from quantgate.serving import (
    Server,
    ServerDied,
    check_endpoint,
    runtime_record,
    served_max_model_len,
    serves_w4a8,
    serving_versions,
)
from quantgate.teams import Team, load_teams

CACHE_DIR = Path(".quantgate/cache/eval")
TIMING = "timing.json"  # per build: server start vs scoring seconds (benchmarks/pipeline_cost.py reads it)


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


@dataclass(frozen=True)
class Scoring:
    """One build's scoring (serving_config): the build's name and folder, its manifest (verified), the digest of
    its other files (config_digest), the precision and serving records (a remote endpoint's, or a Ray node's,
    where it is scored there), the harness."""

    build: str
    model_dir: Path
    manifest: dict
    model_files: str
    precision: dict
    serving: ServingRecord
    harness: HarnessParams

    def key(self, team: Team) -> str:
        """The team's cache key for this build (cache_key)."""
        return cache_key(self.manifest["weights_digest"], team, self.harness, self.serving.dump(), self.model_files)

    def uncached(self, teams: list[Team]) -> list[tuple[Team, str]]:
        """[(team, its cache key)] of `teams` whose scores are not in CACHE_DIR."""
        return [(team, key) for team in teams if not (CACHE_DIR / (key := self.key(team)) / SCORES).is_file()]


def from_cache(
    scoring: Scoring, teams: list[Team], out_dir: Path, timing: dict
) -> tuple[dict[str, TeamScores], list[tuple[Team, str]]]:
    """Copy every team already scored for `scoring` (its build and serving record) from CACHE_DIR into
    OUT_DIR/<team>/.

    Returns ({team: its cached scores}, [(team, cache key) still to score]); appends the cached teams'
    names to `timing["cached"]`. The key (Scoring.key, cache_key) includes the build's serving settings (its KV
    cache dtype, W4A8) through `model_files` (quantgate.manifest.config_digest): they change what the build computes.
    """
    docs, pending = {}, []
    for team in teams:
        key = scoring.key(team)
        cached = CACHE_DIR / key
        if (cached / SCORES).is_file():
            shutil.copytree(cached, out_dir / team.name)
            docs[team.name] = read_scores(cached / SCORES)
            timing["cached"].append(team.name)
            print(f"evaluate[{scoring.build}]: {team.name}: from cache {key[:12]}", flush=True)
        else:
            pending.append((team, key))
    return docs, pending


def score_on(
    server: Server, scoring: Scoring, pending: list[tuple[Team, str]], out_dir: Path, timing: dict, who: str
) -> Iterator[tuple[Team, TeamScores]]:
    """Score each (team, cache key) of `pending` on `server` in turn (score_teams), with a progress line for
    `who` (e.g. "evaluate[int8]"); write each team's OUT_DIR/<team>/ and keep an "ok" one in CACHE_DIR; record
    its scoring seconds in `timing["scoring_s"]`; yield (team, its stamped scores). Raises QuantgateError when
    lm-eval's client cannot be made (make_lm); a team's own failure is its scores' status "error"."""
    lm = make_lm(server, scoring.model_dir.resolve(), scoring.harness, scoring.serving.max_model_len)
    here = local_placement(scoring.precision, scoring.serving)
    scored = score_teams(server, lm, [(team, None) for team, _ in pending], scoring.harness)
    for i, scores, raw, seconds in progress(scored, desc=f"{who}: scoring", unit="team", total=len(pending)):
        team, key = pending[i]
        if seconds is not None:
            timing["scoring_s"][team.name] = seconds
        if scores.status == "ok":
            scores = scores.model_copy(update={"placement": [here]})
        scores = stamped(scores, team, scoring.build, key, scoring.manifest, scoring.serving)
        write_team(out_dir / team.name, scores, raw)
        if scores.status == "ok":
            shutil.copytree(out_dir / team.name, CACHE_DIR / key, dirs_exist_ok=True)
        yield team, scores


def scoring_of(build: str, model_dir: Path, params: EvaluateParams) -> tuple[Scoring, dict | None]:
    """(the Scoring of `build` as `params` serve it, the remote endpoint's evidence or None: serving_config).
    Raises QuantgateError as verify_weights and serving_config do."""
    manifest = verify_weights(model_dir)
    precision, serving, remote = serving_config(build, model_dir, manifest["weights_digest"], params)
    return Scoring(build, model_dir, manifest, config_digest(model_dir), precision, serving, params.harness), remote


def score_for_evaluate(
    server: Server, build: str, model_dir: Path, evals_dir: Path, params: EvaluateParams, timing: dict | None = None
) -> None:
    """On `server`, which profile@<build> started with evaluate.serve and has measured, score every team of
    `evals_dir` that evaluate@<build> would score and finds not in CACHE_DIR, keeping the "ok" ones there
    (module docstring); each team's scoring seconds go in `timing["scoring_s"]` where given. Not for a build with
    an endpoint (evaluate.endpoints: scored there). Never raises
    (but KeyboardInterrupt): what is not scored here is printed, and evaluate@<build> scores it on its own."""
    who = f"profile[{build}]"
    try:
        scoring, _ = scoring_of(build, model_dir, params)
        pending = scoring.uncached(load_teams(evals_dir))
        if not pending:
            return
        print(f"{who}: scoring {len(pending)} team(s) for evaluate@{build} on this server", flush=True)
        with tempfile.TemporaryDirectory(prefix="quantgate-scores-") as tmp:
            timing = timing if timing is not None else {}
            timing.setdefault("scoring_s", {})
            for team, scores in score_on(server, scoring, pending, Path(tmp), timing, who):
                if scores.status == "ok":
                    print(f"{who}: {team.name}: kept for evaluate@{build} ({scores.cache_key[:12]})", flush=True)
                else:
                    print(
                        f"{who}: {team.name}: not scored here ({scores.reason}); left to evaluate@{build}", flush=True
                    )
    except Exception as exc:  # evaluate@<build> scores what is missing and reports its own errors
        print(f"{who}: teams not scored on this server ({one_line(exc)}); left to evaluate@{build}", flush=True)
