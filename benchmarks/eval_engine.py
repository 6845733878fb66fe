"""Does the evaluation engine change the gate's inputs, and what does each engine cost?

The same team tasks (every team under evals/, the first `--limit` docs per task) are scored
on one build twice: (a) through a vLLM OpenAI server exactly as the evaluate stage does
(`make_lm` + `run_team`: local-completions on token ids) and (b) with lm-eval's in-process
`hf` backend (transformers, same dtype as the server, same `simple_evaluate` arguments).

Run (CPU or GPU, same script; on a GPU set evaluate.serve.dtype to bfloat16 in params.yaml):
    .venv/bin/python -m benchmarks.eval_engine [--build fp16] [--models models] [--evals evals]
        [--limit 12] [--cpu-cores 0] [--batch-size 16] [--work DIR]
`--cpu-cores` pins the vLLM worker (VLLM_CPU_OMP_THREADS_BIND) so it does not share a core
with another server on a CPU machine; it is ignored on a GPU.

Columns (one row per team, then `all` = every team, then `setup`):
  team        team folder name; `setup` row: the engine's start-up instead of scoring
  docs        documents scored per engine (sum over the team's tasks)
  requests    lm-eval requests per engine: one per choice of a multiple_choice doc
              (loglikelihood), one per generate_until doc
  vllm_score  mean per-sample score (team metric) through vLLM; hf_score: through hf
  agree_pct   % of docs whose per-sample score is equal on both engines
  abs_diff    |vllm_score - hf_score| in metric units
  vllm_s      scoring seconds through vLLM: time inside lm-eval's request calls (loglikelihood,
              generate_until), without task/dataset building (`setup` row: server start, s)
  hf_s        the same through hf (`setup` row: model load, s)
  vllm_rps    requests per second of scoring through vLLM; hf_rps: through hf
Results also go to benchmarks/results/eval_engine.json.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks.common import REPO, cpu_cores_arg, hf_lm, path_arg, report, rounded
from pipeline.evaluate import EvaluateParams
from pipeline.team_scores import make_lm
from quantgate.errors import QuantgateError, run_main
from quantgate.params import load_block
from quantgate.scoring import run_team, selected_filter
from quantgate.serving import resolved, vllm_server
from quantgate.teams import load_teams

WORK = REPO / ".quantgate" / "bench" / "eval_engine"


def count_requests(team, raw: list[dict]) -> int:
    """lm-eval requests behind a team's scored samples (one per loglikelihood choice or generation)."""
    filters = {t.name: selected_filter(t.config) for t in team.tasks}
    return sum(len(s.get("arguments") or [None]) for s in raw if s.get("filter", "none") == filters[s["task"]])


def timed(lm) -> list[float]:
    """Wrap `lm`'s request methods so the seconds spent inside them add up in the returned list."""
    spent = [0.0]
    for name in ("loglikelihood", "loglikelihood_rolling", "generate_until"):

        def wrapper(*a, _orig=getattr(lm, name), **kw):  # noqa: B008 - binds this method now, on purpose
            started = time.monotonic()
            try:
                return _orig(*a, **kw)
            finally:
                spent[0] += time.monotonic() - started

        setattr(lm, name, wrapper)
    return spent


def score_all(lm, teams, harness) -> dict:
    """{team: {"doc", "requests", "seconds" (inside the engine), "wall" (whole lm-eval run)}} through `lm`."""
    out, spent = {}, timed(lm)
    for team in teams:
        started, before = time.monotonic(), spent[0]
        doc, raw = run_team(lm, team, harness)
        out[team.name] = {
            "doc": doc,
            "requests": count_requests(team, raw),
            "seconds": spent[0] - before,
            "wall": time.monotonic() - started,
        }
        print(
            f"eval_engine: {team.name}: {spent[0] - before:.1f} s scoring, {time.monotonic() - started:.1f} s wall",
            flush=True,
        )
    return out


def run_vllm(model_dir: Path, build: str, teams, params: EvaluateParams, work: Path) -> tuple[float, dict]:
    """(server start s, per-team results) through a vLLM server, as the evaluate stage runs it."""
    started = time.monotonic()
    with vllm_server(params.serve, model_dir, build, work / "server.log") as server:
        setup = time.monotonic() - started
        return setup, score_all(
            make_lm(server, model_dir, params.harness, params.serve.max_model_len), teams, params.harness
        )


def run_hf(model_dir: Path, teams, params: EvaluateParams, batch_size: int) -> tuple[float, dict]:
    """(model load s, per-team results) through lm-eval's in-process hf backend."""
    started = time.monotonic()
    lm = hf_lm(model_dir, params, batch_size)
    return time.monotonic() - started, score_all(lm, teams, params.harness)


def agreement(a: dict, b: dict) -> tuple[int, int]:
    """(docs with equal per-sample score, docs compared) between two scores documents."""
    sa = {(s["task"], s["doc_id"]): s["score"] for s in a["samples"]}
    sb = {(s["task"], s["doc_id"]): s["score"] for s in b["samples"]}
    keys = sa.keys() & sb.keys()
    return sum(sa[k] == sb[k] for k in keys), len(keys)


def main() -> None:
    ap = argparse.ArgumentParser(prog="benchmarks.eval_engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="fp16", help="build folder name under --models (default fp16)")
    ap.add_argument("--models", type=path_arg, default=Path("models"))
    ap.add_argument("--evals", type=path_arg, default=Path("evals"), help="team eval sets (default evals)")
    ap.add_argument(
        "--work", type=path_arg, default=WORK, help="folder for the server log (default .quantgate/bench/eval_engine)"
    )
    ap.add_argument("--limit", type=int, default=12, help="docs per task (default 12)")
    ap.add_argument(
        "--cpu-cores", type=cpu_cores_arg, default=None, help='vLLM CPU cores to bind, e.g. "0" (default: vLLM auto)'
    )
    ap.add_argument("--batch-size", type=int, default=None, help="hf batch size (default evaluate.harness.batch_size)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if args.limit is not None and args.limit < 1:
        raise QuantgateError(f"--limit must be >= 1, got {args.limit}")
    if args.batch_size is not None and args.batch_size < 1:
        raise QuantgateError(f"--batch-size must be >= 1, got {args.batch_size}")
    if not args.build.replace("_", "").replace("-", "").isalnum():
        raise QuantgateError(f"--build {args.build!r}: give a build folder name under --models, e.g. fp16")
    model_dir = (args.models / args.build).resolve()
    if not (model_dir / "config.json").is_file():
        raise QuantgateError(
            f"no build {args.build!r}: {model_dir}/config.json not found (builds are folders "
            f"under --models {args.models}; run `dvc repro` first)"
        )
    teams = load_teams(args.evals)
    params = load_block("evaluate", EvaluateParams)
    params = params.model_copy(update={"serve": resolved(params.serve)})  # dtype auto -> the run's precision
    params = params.model_copy(
        update={
            "serve": params.serve.model_copy(update={"cpu_cores": args.cpu_cores}),
            "harness": params.harness.model_copy(update={"limit": args.limit}),
        }
    )
    vllm_setup, vllm, vllm_error = None, {}, None
    try:
        vllm_setup, vllm = run_vllm(model_dir, args.build, teams, params, args.work)
    except QuantgateError as exc:  # e.g. a build this vLLM cannot serve: still measure hf
        vllm_error = str(exc)
        print(f"eval_engine: vLLM failed: {exc}", flush=True)
    hf_setup, hf = run_hf(model_dir, teams, params, args.batch_size or params.harness.batch_size)

    rows, tot = [], {"docs": 0, "req": 0, "eq": 0, "n": 0, "vs": 0.0, "hs": 0.0, "vsum": 0.0, "hsum": 0.0}
    for team in teams:
        v, h = vllm.get(team.name), hf[team.name]
        docs = len(h["doc"]["samples"])
        hmean = sum(s["score"] for s in h["doc"]["samples"]) / docs
        row = {
            "team": team.name,
            "docs": docs,
            "requests": h["requests"],
            "vllm_score": None,
            "hf_score": rounded(hmean, 3),
            "agree_pct": None,
            "abs_diff": None,
            "vllm_s": None,
            "hf_s": rounded(h["seconds"], 1),
            "vllm_rps": None,
            "hf_rps": rounded(h["requests"] / h["seconds"], 1),
        }
        tot["docs"] += docs
        tot["req"] += h["requests"]
        tot["hs"] += h["seconds"]
        tot["hsum"] += hmean * docs
        if v:
            vmean = sum(s["score"] for s in v["doc"]["samples"]) / len(v["doc"]["samples"])
            eq, n = agreement(v["doc"], h["doc"])
            row.update(
                vllm_score=rounded(vmean, 3),
                agree_pct=rounded(100 * eq / n, 1),
                abs_diff=rounded(abs(vmean - hmean), 3),
                vllm_s=rounded(v["seconds"], 1),
                vllm_rps=rounded(v["requests"] / v["seconds"], 1),
            )
            if v["requests"] != h["requests"]:
                row["requests"] = f"{v['requests']}/{h['requests']}"
            tot["eq"] += eq
            tot["n"] += n
            tot["vs"] += v["seconds"]
            tot["vsum"] += vmean * docs
        rows.append(row)
    rows.append(
        {
            "team": "all",
            "docs": tot["docs"],
            "requests": tot["req"],
            "vllm_score": rounded(tot["vsum"] / tot["docs"], 3) if vllm else None,
            "hf_score": rounded(tot["hsum"] / tot["docs"], 3),
            "agree_pct": rounded(100 * tot["eq"] / tot["n"], 1) if tot["n"] else None,
            "abs_diff": rounded(abs(tot["vsum"] - tot["hsum"]) / tot["docs"], 3) if vllm else None,
            "vllm_s": rounded(tot["vs"], 1) if vllm else None,
            "hf_s": rounded(tot["hs"], 1),
            "vllm_rps": rounded(tot["req"] / tot["vs"], 1) if vllm else None,
            "hf_rps": rounded(tot["req"] / tot["hs"], 1),
        }
    )
    rows.append(
        {
            "team": "setup",
            "docs": None,
            "requests": None,
            "vllm_score": None,
            "hf_score": None,
            "agree_pct": None,
            "abs_diff": None,
            "vllm_s": rounded(vllm_setup, 1),
            "hf_s": rounded(hf_setup, 1),
            "vllm_rps": None,
            "hf_rps": None,
        }
    )
    notes = [
        f"build {args.build} ({model_dir}), dtype {params.serve.dtype} on both engines, --limit {args.limit} "
        f"docs per task; scores are per-sample team metrics (0/1), times in seconds",
        "setup row: vLLM = server start until /health and a smoke request; hf = HFLM model + tokenizer load",
        "all row: abs_diff and scores are doc-weighted over all teams",
        "lm-eval wall per team incl. task/dataset building (s): "
        + "; ".join(
            f"{t.name} vllm {vllm[t.name]['wall']:.1f} hf {hf[t.name]['wall']:.1f}"
            if vllm
            else f"{t.name} hf {hf[t.name]['wall']:.1f}"
            for t in teams
        ),
    ]
    if vllm_error:
        notes.append(f"vLLM columns empty: {vllm_error}")
    report(
        "eval_engine",
        f"eval engine: vLLM server vs lm-eval hf in-process ({args.build})",
        rows,
        meta={
            "build": args.build,
            "limit": args.limit,
            "dtype": params.serve.dtype,
            "cpu_cores": args.cpu_cores,
            "hf_batch_size": args.batch_size or params.harness.batch_size,
            "vllm_batch_size": params.harness.batch_size,
            "num_concurrent": params.harness.num_concurrent,
        },
        notes=notes,
    )


if __name__ == "__main__":
    run_main(main)
