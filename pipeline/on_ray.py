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
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

from pipeline.evaluate import (
    CACHE_DIR,
    TIMING,
    EvaluateParams,
    cache_key,
    drop_credentials,
    local_placement,
    make_lm,
    score_teams,
    serving_config,
    stamped,
    write_team,
)
from quantgate import store
from quantgate.errors import QuantgateError
from quantgate.executor import ExecutorParams, connect, failure
from quantgate.manifest import config_digest, verify_weights
from quantgate.precision import RECORD as PRECISION
from quantgate.results import SCORES, ServingRecord, TeamScores, read_scores
from quantgate.serving import vllm_server
from quantgate.sharding import merge, plan
from quantgate.teams import load_team, load_teams

PROJECT = Path(__file__).resolve().parents[1]  # the project install on a node (the image's checkout)
LOG_TAIL = 200_000  # bytes of each server log a task sends back


def node_params(params: dict) -> EvaluateParams:
    """The evaluate block as a node runs it: a relative serving python is the node's own project install's."""
    p = EvaluateParams.model_validate(params)
    python = Path(p.serve.python)
    if not python.is_absolute():
        serve = p.serve.model_copy(update={"python": str(PROJECT / python)})
        p = p.model_copy(update={"serve": serve})
    return p


def team_files(folder: Path) -> dict[str, bytes]:
    """{path relative to the team folder: content} of every file of a team folder (validated: bounded)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def score_share(request: dict) -> dict:
    """Run on a Ray node: fetch the build, then (unless `request["probe"]`) serve it and score the share.

    Returns {"node", "precision", "serving"} and, for a share, {"teams": [{"index", "scores", "raw",
    "seconds"}], "log", "server_start_s"}. Raises QuantgateError (naming the node) for a build it cannot
    fetch or a serving env it cannot use; a server that does not start or dies is in the teams' scores.
    """
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), None)  # as it joined
    node = {"node_id": node_id, "ip": ip or ray.util.get_node_ip_address(), "host": socket.gethostname()}
    work = Path(tempfile.mkdtemp(prefix="quantgate-eval-"))
    os.chdir(work)  # never the pipeline machine's project folder: nothing here is read from it
    try:
        model_dir = store.fetch(request["store"], request["where"], Path(request["node_cache"]))
        drop_credentials(os.environ)  # after the fetch, before lm-eval renders any team's templates
        params = node_params(request["params"])
        manifest = verify_weights(model_dir)
        precision, serving, _ = serving_config(request["build"], model_dir, manifest["weights_digest"], params)
        reply = {"node": node, "precision": precision, "serving": serving.dump()}
        if request.get("probe"):
            return reply
        items = []
        for piece in request["pieces"]:
            folder = work / "evals" / piece["team"]
            for rel, data in piece["files"].items():
                (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                (folder / rel).write_bytes(data)
            team = load_team(folder)
            if team.scores_digest != piece["scores_digest"]:
                raise QuantgateError(f"team {team.name}: its files arrived changed on node {node['ip']}")
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
    except QuantgateError as exc:
        raise QuantgateError(f"Ray node {node['ip']} ({node['node_id'][:12]}): {exc}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _remote(executor: ExecutorParams):
    import ray

    return ray.remote(**executor.ray_options())(score_share)  # max_calls is not an .options() key


def _probe(executor: ExecutorParams, request: dict) -> dict:
    import ray
    import ray.exceptions as rex

    try:
        return ray.get(_remote(executor).remote({**request, "probe": True}))
    except rex.RayTaskError as exc:  # the task raised: its own one-line reason
        cause = exc.cause if isinstance(exc.cause, QuantgateError) else exc
        raise QuantgateError(str(cause).strip().splitlines()[0]) from None
    except rex.RayError as exc:
        raise QuantgateError(f"the probe task {failure(exc, executor.max_retries + 1)}") from None


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
    where = store.publish(model_dir, executor.store or store.default_store())
    request = {
        "build": build,
        "store": executor.store or store.default_store(),
        "where": where,
        "node_cache": executor.node_cache,
        "params": params.model_dump(mode="json"),
    }
    print(f"evaluate[{build}]: on Ray at {address}: published as {where[:20]}...; probing a node", flush=True)
    probe = _probe(executor, request)
    precision, serving = probe["precision"], ServingRecord.model_validate(probe["serving"])
    serve_config = serving.dump()
    if (kv := manifest.get("kv_cache_dtype", "auto")) != "auto":
        serve_config["kv_cache_dtype"] = kv
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    docs, pending = {}, []
    timing = {"build": build, "executor": "ray", "server_start_s": 0.0, "replicas": [], "scoring_s": {}, "cached": []}
    for team in teams:
        key = cache_key(manifest["weights_digest"], team, params.harness, serve_config, config_digest(model_dir))
        if (CACHE_DIR / key / SCORES).is_file():
            shutil.copytree(CACHE_DIR / key, out_dir / team.name)
            docs[team.name] = read_scores(CACHE_DIR / key / SCORES)
            timing["cached"].append(team.name)
            print(f"evaluate[{build}]: {team.name}: from cache {key[:12]}", flush=True)
        else:
            pending.append((team, key))
    by_name = {team.name: (team, key) for team, key in pending}
    shares = [s for s in plan([t for t, _ in pending], executor.replicas, params.harness.limit) if s]
    refs = []
    for share in shares:
        pieces = [
            {
                "team": p.team,
                "docs": p.docs,
                "files": team_files(by_name[p.team][0].path),
                "scores_digest": by_name[p.team][0].scores_digest,
            }
            for p in share
        ]
        refs.append(_remote(executor).remote({**request, "pieces": pieces}))
    if refs:
        print(f"evaluate[{build}]: {len(refs)} replica(s) scoring {len(pending)} team(s)", flush=True)
    parts: dict[str, list[TeamScores]] = {}
    raws: dict[str, list[dict]] = {}
    logs, nodes = [], {}
    for r, (share, outcome) in enumerate(zip(shares, outcomes(refs, executor), strict=True)):
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


def outcomes(refs: list, executor: ExecutorParams, poll_s: float = 2.0) -> list[tuple[dict | None, str | None]]:
    """(reply, None) or (None, one-line reason) for each task of `refs`, in order, once all are settled.

    Ray re-runs a task whose node died (executor.max_retries), but a re-run that no live node can take would
    wait for ever: when no live node has the resources one task asks for any more, the tasks still running
    are cancelled and their reason names the nodes that died.
    """
    import ray
    import ray.exceptions as rex

    started = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
    need = {k: v for k, v in executor.demand().items() if v}
    waiting, done = list(refs), {}
    while waiting:
        ready, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=poll_s)
        for ref in ready:
            try:
                done[ref] = (ray.get(ref), None)
            except rex.RayTaskError as exc:  # the task raised: its own one-line reason
                cause = exc.cause if isinstance(exc.cause, QuantgateError) else exc
                done[ref] = (None, str(cause).strip().splitlines()[0])
            except rex.RayError as exc:
                done[ref] = (None, failure(exc, executor.max_retries + 1))
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if waiting and not any(all(n["Resources"].get(k, 0) >= v for k, v in need.items()) for n in alive):
            gone = [n for i, n in started.items() if i not in {a["NodeID"] for a in alive}]
            dead = ", ".join(f"{n['NodeManagerAddress']} ({n['NodeID'][:12]})" for n in gone) or "none"
            asks = ", ".join(f"{k}={v:g}" for k, v in need.items())
            for ref in waiting:
                ray.cancel(ref, force=True)
                done[ref] = (None, f"the Ray node it ran on died ({dead}) and no live node has {asks} to run it again")
            waiting = []
    return [done[ref] for ref in refs]


def _differs(probe: dict, node: dict) -> str | None:
    """Why a share's node served at another precision or on another kind of device than the probed node
    (the gate compares builds, not machines), or None."""
    for field in ("dtype", "machine_kind"):
        if probe.get(field) != node.get(field):
            return f"at {field} {node.get(field)}, but the build's record says {probe.get(field)}"
    return None
