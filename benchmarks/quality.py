"""The recipe sweep: how much quality each quantized build keeps per team, with its size and quantization time.

Builds: every quantized build of params.yaml (`quantize.<build>`: recipes/fp8.yaml, int8.yaml, int4.yaml)
and every recipe under recipes/sweep/ (named by the file's stem, calibrated as quantize.int4 says; AutoRound
with the sequential pipeline), made with pipeline.quantize into --work from --models/fp16 and the calibrate
stage's conversations (--calibration; a build in --models or --work whose recipe record matches is
reused). Every team is scored on fp16 and each build with ONE engine; the scores documents (the evaluate
stage's TeamScores) go to WORK/scores/<build>/<team>/scores.json and are judged with quantgate.judging.judge.

Engine (--engine): vllm = a vLLM server per build, as the evaluate stage; hf = lm-eval's
in-process hf backend (transformers decompresses compressed-tensors fp8, int8 and W4A16 weights;
fp8 and int8 activations are still quantized per token in the forward pass); auto = vllm where it
serves W4A16 (GPUs, AVX512 CPUs at 16-bit), else hf. Weight quality does not depend on the serving
kernel, so hf is a valid quality engine.

Run (CPU or GPU, same script):
    .venv/bin/python -m benchmarks.quality [--engine auto|vllm|hf] [--limit N] [--work DIR]
        [--models models] [--evals evals] [--calibration results/calibration.jsonl] [--only b1,b2]
        [--cpu-cores 0] [--reuse-scores]

Columns (one row per team and build):
  team, build   team folder; candidate build (baseline is fp16)
  recipe        the recipe file
  n             paired documents compared
  fp16          baseline mean per-sample score (team metric); candidate: the build's
  recovery_pct  100 * candidate / fp16 (metric where higher is better)
  ci_low, ci_high  recovery % interval from the gate's one-sided drop bounds at the team's
                confidence (pipeline.plot.recovery_interval)
  verdict       the gate verdict at the team's margin (PASS / INCONCLUSIVE / FAIL / ANOMALOUS)
  size_mib      weight files of the build
  quantize_s    seconds pipeline.quantize took for this build in --work (load, oneshot, save; a build
                left by an earlier run keeps that run's time); "reused" = the pipeline's build in --models
A build whose quantization fails (an llm-compressor error) is left out of the table and named
with the error in the notes; the sweep goes on. Results also go to benchmarks/results/quality.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from benchmarks.common import REPO, cpu_cores_arg, hf_lm, path_arg, report, rounded
from pipeline.evaluate import EvaluateParams
from pipeline.gate import load_params
from pipeline.plot import recovery_interval
from pipeline.quantize import QuantizeParams, quantize, recipe_record, same_recipe
from pipeline.team_scores import make_lm, write_team
from quantgate.errors import QuantgateError, run_main
from quantgate.judging import judge
from quantgate.manifest import read_manifest
from quantgate.params import BASELINE_BUILD, load_block, load_builds
from quantgate.precision import probe, resolve_dtype, w4a16_problem
from quantgate.recipes import load_recipe, needs_data, needs_sequential
from quantgate.results import read_scores
from quantgate.scoring import run_team
from quantgate.serving import resolved, vllm_server
from quantgate.teams import load_teams

SWEEP = REPO / "recipes" / "sweep"
SWEEP_CALIBRATION = "quantize.int4"  # the sweep's int4 variants calibrate as the default int4 build


def build_params(only: list[str] | None = None) -> dict[str, QuantizeParams]:
    """{build: QuantizeParams}: params.yaml's quantized builds, then recipes/sweep/*.yaml by stem, calibrated
    as quantize.int4 (with the sequential pipeline for recipes that need it: AutoRound, AWQ); `only` keeps the
    named ones. Raises QuantgateError for a name in `only` that is neither."""
    builds = {b: load_block(f"quantize.{b}", QuantizeParams) for b in load_builds() if b != BASELINE_BUILD}
    calibration = load_block(SWEEP_CALIBRATION, QuantizeParams).calibration
    for path in sorted(SWEEP.glob("*.yaml")):
        c = calibration
        if c is not None and needs_sequential(load_recipe(path.stem, path, "the sweep's recipe")):
            c = c.model_copy(update={"pipeline": "sequential"})  # AutoRound, AWQ: quantgate.recipes.SEQUENTIAL_ONLY
        builds[path.stem] = QuantizeParams(recipe=str(path.relative_to(REPO)), calibration=c)
    if only:
        if unknown := [b for b in only if b not in builds]:
            raise QuantgateError(f"--only {unknown[0]}: not a build; choose from {sorted(builds)}")
        builds = {b: p for b, p in builds.items() if b in only}
    return builds


def matches(model_dir: Path, p: QuantizeParams, source_digest: str, calibration: Path) -> bool:
    """True if `model_dir` holds a build made with exactly `p` (recipe content, calibration settings and
    data) from the source weights (pipeline.quantize.same_recipe)."""
    try:
        m = read_manifest(model_dir)
    except Exception:
        return False
    recipe = load_recipe(p.recipe, REPO / p.recipe, "the sweep's recipe")
    data = calibration if needs_data(recipe) else None
    return same_recipe(m.get("recipe") or {}, recipe_record(p, REPO / p.recipe, source_digest, data))


def ensure_build(
    build: str, p: QuantizeParams, src: Path, models: Path, work: Path, calibration: Path
) -> tuple[Path, float | None]:
    """(model dir, quantize seconds or None if reused) for `build`."""
    digest = read_manifest(src)["weights_digest"]
    out = work / "builds" / build
    if matches(models / build, p, digest, calibration):
        print(f"quality: {build}: reusing {models / build}", flush=True)
        return models / build, None
    if matches(out, p, digest, calibration) and (out / "quantize_s.txt").is_file():
        print(f"quality: {build}: reusing {out}", flush=True)
        return out, float((out / "quantize_s.txt").read_text())
    started = time.monotonic()
    quantize(build, src, out, p, calibration)  # recipe paths are relative to the repo root, the cwd
    seconds = time.monotonic() - started
    (out / "quantize_s.txt").write_text(f"{seconds:.1f}\n")
    return out, seconds


def size_mib(model_dir: Path) -> float:
    """MiB of the build's weight files (*.safetensors)."""
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20


def choose_engine(engine: str, python: str, dtype: str = "auto") -> tuple[str, str]:
    """(engine, why) for --engine auto|vllm|hf; auto asks the serving env at `python` which
    platform vLLM runs on and whether it serves W4A16 at evaluate.serve.dtype `dtype`
    (quantgate.precision)."""
    if engine not in ("auto", "vllm", "hf"):
        raise QuantgateError(f"--engine must be auto, vllm or hf, got {engine!r}")
    if engine != "auto":
        return engine, "chosen with --engine"
    platform = probe(python)
    if not platform.is_cpu:
        return "vllm", f"auto: vLLM runs on {platform.device} here and serves fp8 and W4A16 there"
    w4a16 = w4a16_problem(platform, resolve_dtype(dtype, platform)[0], dtype)
    return "hf", (
        "auto: vLLM runs on CPU here"
        + (f" and cannot serve W4A16 ({w4a16})" if w4a16 else "")
        + " and serves FP8 ~12x slower than fp16, so all builds are scored in-process with lm-eval hf"
    )


def score_build(engine: str, build: str, model_dir: Path, teams, params: EvaluateParams, out: Path) -> float:
    """Score every team on one build, write OUT/<build>/<team>/scores.json; return seconds."""
    started = time.monotonic()

    def run(lm):
        for team in teams:
            doc, raw = run_team(lm, team, params.harness)
            write_team(out / build / team.name, doc.model_copy(update={"team": team.name, "build": build}), raw)
            print(f"quality: {build}/{team.name}: {doc.elapsed_s} s", flush=True)

    if engine == "vllm":
        with vllm_server(params.serve, model_dir.resolve(), build, out / build / "server.log") as server:
            run(make_lm(server, model_dir.resolve(), params.harness, params.serve.max_model_len))
    else:
        run(hf_lm(model_dir.resolve(), params))
    return time.monotonic() - started


def scored(build_dir: Path, teams) -> bool:
    """True if every team has a scores.json under `build_dir` (WORK/scores/<build>)."""
    return all((build_dir / t.name / "scores.json").is_file() for t in teams)


def check_inputs(work: Path, calibration: Path, plan: dict[str, QuantizeParams]) -> None:
    """Raises QuantgateError before any build or score when --work is no folder, or when a build of `plan` calibrates
    and --calibration is no file: each such build failed at its quantization, recorded as a note, and the sweep
    wrote its result without it (a --work file failed the scores' write after fp16 was scored)."""
    if work.exists() and not work.is_dir():
        raise QuantgateError(f"--work {work}: not a folder; give a folder (made when missing)")
    if not calibration.is_file() and (need := [b for b, p in plan.items() if p.calibration is not None]):
        raise QuantgateError(
            f"--calibration {calibration}: no such file, and {', '.join(need)} "
            f"{'calibrates' if len(need) == 1 else 'calibrate'} on it; run "
            "`dvc repro calibrate` (it writes results/calibration.jsonl), give the file, or --only builds without it"
        )


def main() -> None:
    ap = argparse.ArgumentParser(prog="benchmarks.quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="auto", choices=("auto", "vllm", "hf"), help="scoring engine (default auto)")
    ap.add_argument(
        "--limit",
        type=int,
        default=None,
        help="docs per task (default: every doc; the gate needs about 50+ per team to decide at 5-point margins)",
    )
    ap.add_argument("--models", type=path_arg, default=Path("models"), help="holds fp16 and reusable builds")
    ap.add_argument("--evals", type=path_arg, default=Path("evals"), help="team eval sets (default evals)")
    ap.add_argument(
        "--work",
        type=path_arg,
        default=REPO / ".quantgate" / "bench" / "quality",
        help="builds made here and kept for reuse; WORK/scores is replaced on every run",
    )
    ap.add_argument(
        "--calibration",
        type=path_arg,
        default=REPO / "results" / "calibration.jsonl",
        help="the calibrate stage's conversations (default results/calibration.jsonl)",
    )
    ap.add_argument("--only", default=None, help="comma-separated builds to run (default: all)")
    ap.add_argument(
        "--reuse-scores",
        action="store_true",
        help="keep WORK/scores and score only builds without them (re-judge, e.g. after a margin change)",
    )
    ap.add_argument(
        "--cpu-cores", type=cpu_cores_arg, default=None, help='vLLM CPU cores to bind, e.g. "0" (default: vLLM auto)'
    )
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if args.limit is not None and args.limit < 1:
        raise QuantgateError(f"--limit must be >= 1, got {args.limit}")
    src = args.models / "fp16"
    if not (src / "config.json").is_file():
        raise QuantgateError(
            f"{src}/config.json not found: --models must hold the fp16 build (run `dvc repro prepare`)"
        )
    only = [b for b in args.only.split(",") if b] if args.only is not None else None  # "int8," names int8 alone
    if only == []:
        raise QuantgateError(f"--only {args.only!r}: name at least one build, comma-separated (e.g. int8,fp8)")
    plan = build_params(only)
    check_inputs(args.work, args.calibration, plan)
    teams = load_teams(args.evals)
    params = load_block("evaluate", EvaluateParams)
    requested = params.serve.dtype
    params = params.model_copy(update={"serve": resolved(params.serve)})  # dtype auto -> the run's precision
    params = params.model_copy(
        update={
            "serve": params.serve.model_copy(update={"cpu_cores": args.cpu_cores}),
            "harness": params.harness.model_copy(update={"limit": args.limit}),
        }
    )
    engine, why = choose_engine(args.engine, params.serve.python, requested)
    builds = {"fp16": (src, None)}
    failed: dict[str, str] = {}  # build -> why quantization failed (the sweep goes on without it)
    for build, p in plan.items():
        try:
            builds[build] = ensure_build(build, p, src, args.models, args.work, args.calibration)
        except Exception as exc:  # a library's own error (e.g. a modifier that needs a GPU): record, go on
            failed[build] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            print(f"quality: {build}: quantization failed: {failed[build]}", flush=True)
    scores = args.work / "scores"
    if not args.reuse_scores:
        shutil.rmtree(scores, ignore_errors=True)
    eval_s = {
        b: 0.0 if args.reuse_scores and scored(scores / b, teams) else score_build(engine, b, d, teams, params, scores)
        for b, (d, _) in builds.items()
    }

    gate = load_params()
    gate = gate.model_copy(update={"candidates": [b for b in builds if b != gate.baseline]})
    rows = []
    for team in teams:
        base = read_scores(scores / gate.baseline / team.name / "scores.json")
        for build in gate.candidates:
            r = judge(team, base, read_scores(scores / build / team.name / "scores.json"), gate, build)
            ci = recovery_interval(r) or (None, None)
            q = builds[build][1]
            rows.append(
                {
                    "team": team.name,
                    "build": build,
                    "recipe": plan[build].recipe,
                    "n": r.n,
                    "fp16": rounded(r.baseline, 3),
                    "candidate": rounded(r.candidate, 3),
                    "recovery_pct": rounded(r.recovery_pct, 1),
                    "ci_low": rounded(ci[0], 1),
                    "ci_high": rounded(ci[1], 1),
                    "verdict": str(getattr(r.verdict, "value", r.verdict)),  # documents keep enums as str
                    "size_mib": round(size_mib(builds[build][0]), 1),
                    "quantize_s": "reused" if q is None else rounded(q, 1),
                }
            )
    notes = [
        f"engine: {engine} ({why})",
        f"--limit {args.limit or 'all'} docs per task; metric per team from evals/<team>/team.yaml; "
        f"dtype {params.serve.dtype}",
        "scoring seconds per build (all teams): " + ", ".join(f"{b} {s:.0f}" for b, s in eval_s.items()),
        "builds: " + ", ".join(f"{b}={d}" for b, (d, _) in builds.items()),
        *(f"{b} ({plan[b].recipe}): not built, quantization failed: {why}" for b, why in failed.items()),
        f"scores documents under {scores}",
    ]
    report(
        "quality",
        f"recovery per team and build vs fp16 (engine {engine})",
        rows,
        meta={
            "engine": engine,
            "engine_reason": why,
            "limit": args.limit,
            "dtype": params.serve.dtype,
            "builds": {b: {"dir": str(d), "quantize_s": rounded(q, 1)} for b, (d, q) in builds.items()},
            "scoring_s": {b: round(s, 1) for b, s in eval_s.items()},
            "failed": failed,
            "gate": gate.model_dump(),
        },
        notes=notes,
    )


if __name__ == "__main__":
    run_main(main)
