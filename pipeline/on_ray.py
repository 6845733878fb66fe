"""evaluate@<build> on a Ray cluster (`executor.kind: ray`, quantgate/executor.py; issue 31).

The stage still runs where `dvc repro` runs and still writes exactly its outs there (results/eval/<build>/).
What moves is the heavy part: each of `executor.replicas` Ray tasks fetches the build by content address
(quantgate/store.py: published first, so no node reads a path that exists only here), starts its own vLLM
server from the node's serving env, scores its share of the teams (quantgate/sharding.py) and returns the
scores, lm-eval's samples, its server log and where it ran. Steps:

1. connect: a cluster that does not answer, or has no node with the declared resources, is refused in one
   line before anything is published or started;
2. publish the build to the store; a probe task on a node fetches it and returns the node's precision and
   serving record, so the evaluation cache is keyed as for a local server and a broken node env stops the
   build before any server starts;
3. the shares run; a task whose node or worker dies is retried by Ray on another node with the resources
   (executor.max_retries), then its teams are errors that name the node (quantgate.executor.failure);
4. the driver merges split teams, writes every team, the server logs, timing and precision records.

A task runs in a fresh worker process (max_calls=1) from a folder of its own, drops registry and cloud
credentials after the fetch and before any team template is rendered, and its vLLM server's process group is
killed with it even when the node kills the worker (quantgate.serving.orphan_guard).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from pipeline.team_scores import (
    CACHE_DIR,
    TIMING,
    Scoring,
    from_cache,
    local_placement,
    make_lm,
    score_teams,
    serving_config,
    stamped,
    write_team,
)
from quantgate.errors import QuantgateError
from quantgate.evaluate_params import EvaluateParams
from quantgate.executor import ExecutorParams, connect
from quantgate.manifest import config_digest, verify_weights
from quantgate.precision import RECORD as PRECISION
from quantgate.remote import folder_files, node_python, on_node, published, settle, submit
from quantgate.results import ServingRecord, TeamScores
from quantgate.serving import vllm_server
from quantgate.sharding import merge, plan
from quantgate.teams import load_team, load_teams

LOG_TAIL = 200_000  # bytes of each server log a task sends back


def node_params(params: dict) -> EvaluateParams:
    """The evaluate block as a node runs it: a relative serving python is the node's own project install's."""
    p = EvaluateParams.model_validate(params)
    serve = p.serve.model_copy(update={"python": node_python(p.serve.python)})
    return p.model_copy(update={"serve": serve})


def score_share(request: dict) -> dict:
    """Run on a Ray node: fetch the build, then (unless `request["probe"]`) serve it and score the share.

    Returns {"node", "precision", "serving"} and, for a share, {"teams": [{"index", "scores", "raw",
    "seconds"}], "log", "server_start_s"}. Raises QuantgateError (naming the node) for a build it cannot
    fetch or a serving env it cannot use; a server that does not start or dies is in the teams' scores.
    """
    with on_node(request) as (node, model_dir, work):
        params = node_params(request["params"])
        manifest = verify_weights(model_dir)
        precision, serving, _ = serving_config(request["build"], model_dir, manifest["weights_digest"], params)
        reply = {"node": node, "precision": precision, "serving": serving.dump()}
        if request.get("probe"):
            return reply
        items = []
        for piece in request["pieces"]:  # on_node wrote each team's files under evals/<team>/
            team = load_team(work / "evals" / piece["team"])
            if team.scores_digest != piece["scores_digest"]:
                raise QuantgateError(f"team {team.name}: its files arrived changed")
            items.append((team, piece["docs"]))
        started = time.monotonic()
        log = work / "server.log"
        teams = []
        try:
            with vllm_server(params.serve, model_dir, request["build"], log) as server:
                reply["server_start_s"] = round(time.monotonic() - started, 1)
                lm = make_lm(server, model_dir, params.harness, serving.max_model_len)
                for i, scores, raw, seconds in score_teams(server, lm, items, params.harness):
                    teams.append({"index": i, "scores": scores.dump(), "raw": raw, "seconds": seconds})
        except QuantgateError as exc:  # the server did not start: every piece of the share is an error
            error = TeamScores(status="error", reason=f"{exc} (Ray node {node['ip']})").dump()
            teams = [{"index": i, "scores": error, "raw": None, "seconds": None} for i in range(len(items))]
        reply["teams"] = teams
        reply["log"] = log.read_bytes()[-LOG_TAIL:].decode(errors="replace") if log.exists() else ""
        return reply


def evaluate_on_ray(
    build: str, model_dir: Path, evals_dir: Path, out_dir: Path, params: EvaluateParams, executor: ExecutorParams
) -> dict[str, TeamScores]:
    """Evaluate `build` on every team on the Ray cluster of `executor`; write OUT_DIR as the local path does
    (per team scores.json and samples.jsonl, server.log with every replica's log, timing.json,
    precision.json with the executor and nodes); return {team: its scores}.

    Raises QuantgateError (one line, before any server starts) for a cluster that does not answer or lacks
    the declared resources, a store that refuses the build, or a node that cannot fetch or serve it.
    """
    address = connect(executor)
    manifest = verify_weights(model_dir)
    teams = load_teams(evals_dir)
    request = {"build": build, **published(model_dir, executor), "params": params.model_dump(mode="json")}
    print(
        f"evaluate[{build}]: on Ray at {address}: published as {request['where'][:20]}...; probing a node", flush=True
    )
    ((probe, why),) = settle([submit(score_share, {**request, "probe": True}, executor)], executor)
    if probe is None:
        raise QuantgateError(why)  # before any server starts: the node cannot fetch or serve the build
    precision, serving = probe["precision"], ServingRecord.model_validate(probe["serving"])
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    timing = {"build": build, "executor": "ray", "server_start_s": 0.0, "replicas": [], "scoring_s": {}, "cached": []}
    scoring = Scoring(build, model_dir, manifest, config_digest(model_dir), precision, serving, params.harness)
    docs, pending = from_cache(scoring, teams, out_dir, timing)
    by_name = {team.name: (team, key) for team, key in pending}
    shares = [s for s in plan([t for t, _ in pending], executor.replicas, params.harness.limit) if s]
    refs = []
    for share in shares:
        pieces = [{"team": p.team, "docs": p.docs, "scores_digest": by_name[p.team][0].scores_digest} for p in share]
        files = {k: v for p in share for k, v in folder_files(by_name[p.team][0].path, f"evals/{p.team}").items()}
        refs.append(submit(score_share, {**request, "pieces": pieces, "files": files}, executor))
    if refs:
        print(f"evaluate[{build}]: {len(refs)} replica(s) scoring {len(pending)} team(s)", flush=True)
    parts: dict[str, list[TeamScores]] = {}
    raws: dict[str, list[dict]] = {}
    logs, nodes = [], {}
    for r, (share, outcome) in enumerate(zip(shares, settle(refs, executor), strict=True)):
        reply, reason = outcome
        if reply is None:
            print(f"evaluate[{build}]: replica {r}: {reason}", flush=True)
            for p in share:
                parts.setdefault(p.team, []).append(TeamScores(status="error", reason=reason))
            continue
        node = reply["node"]
        nodes[node["node_id"]] = node
        logs.append(f"===== replica {r} on Ray node {node['ip']} ({node['node_id'][:12]}) =====\n{reply['log']}")
        timing["replicas"].append({"node": node["ip"], "server_start_s": reply.get("server_start_s")})
        here = local_placement(reply["precision"], serving, "ray", node)
        differs = _differs(precision, reply["precision"])
        for item in reply["teams"]:
            piece = share[item["index"]]
            scores = TeamScores.model_validate(item["scores"])
            if differs and scores.status == "ok":
                scores = TeamScores(status="error", reason=f"scored on Ray node {node['ip']} {differs}")
            if scores.status == "ok":
                scores = scores.model_copy(update={"placement": [here]})
            parts.setdefault(piece.team, []).append(scores)
            raws.setdefault(piece.team, []).extend(item["raw"] or [])
            if item["seconds"] is not None:
                timing["scoring_s"][piece.team] = round(timing["scoring_s"].get(piece.team, 0) + item["seconds"], 1)
    for name, (team, key) in by_name.items():
        got = parts.get(name, [])
        bad = next((p for p in got if p.status != "ok"), None)
        if bad is not None or not got:
            scores = bad or TeamScores(status="error", reason="no replica returned its scores")
            raw = None
        elif len(got) == 1:  # scored whole on one server: as on the local executor
            scores, raw = got[0], raws[name]
        else:
            try:
                scores = merge(team, got, params.harness.limit)
                scores = scores.model_copy(update={"placement": [pl for p in got for pl in p.placement]})
                raw = raws[name]
            except QuantgateError as exc:
                scores, raw = TeamScores(status="error", reason=str(exc)), None
        docs[name] = scores = stamped(scores, team, build, key, manifest, serving)
        write_team(out_dir / name, scores, raw)
        if scores.status == "ok":
            shutil.copytree(out_dir / name, CACHE_DIR / key, dirs_exist_ok=True)
        else:
            print(f"evaluate[{build}]: {name}: {scores.status} {scores.reason or ''}", flush=True)
    timing["server_start_s"] = max((x["server_start_s"] or 0.0 for x in timing["replicas"]), default=0.0)
    (out_dir / "server.log").write_text("\n".join(logs))
    (out_dir / TIMING).write_text(json.dumps(timing, indent=1) + "\n")
    record = {**precision, "executor": "ray", "cluster": address, "nodes": sorted(n["ip"] for n in nodes.values())}
    (out_dir / PRECISION).write_text(json.dumps(record, indent=1) + "\n")
    return docs


def _differs(probe: dict, node: dict) -> str | None:
    """Why a share's node served at another precision or on another kind of device than the probed node
    (the gate compares builds, not machines), or None."""
    for field in ("dtype", "machine_kind"):
        if probe.get(field) != node.get(field):
            return f"at {field} {node.get(field)}, but the build's record says {probe.get(field)}"
    return None
