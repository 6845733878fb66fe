"""Question 1: what does `dvc repro` cost on the default model, per stage, cold and warm?

    .venv/bin/python -m benchmarks.pipeline_cost [--limit 12] [--work DIR]

Runs the pipeline of this working tree in a scratch copy (benchmarks.common.scratch_project),
stage by stage (`dvc repro --single-item STAGE`, in the order `dvc repro` runs them), twice:
- cold: a fresh project, empty DVC cache and empty evaluation cache;
- warm: the same project with every output deleted (models/, results/), as a new clone
  that shares the DVC cache and the evaluation cache sees it: prepare and quantize are
  restored from DVC's run-cache, evaluate scores nothing (every (build, team) result is in
  .quantgate/cache/eval) and profile measures nothing (.quantgate/cache/profile), so no server
  starts; validate, gate and register re-run.
Same script on a GPU machine (set-up picks the CUDA vLLM; set evaluate.serve.dtype).

Columns: wall s (the stage's `dvc repro` command, DVC's own start-up of ~1-2 s included),
peak RSS GiB (sum over the stage's process tree, vLLM server included, sampled every 0.2 s),
and for evaluate and profile stages the seconds starting the vLLM server, measuring the build and scoring teams,
read from results/eval/<build>/timing.json and results/logs/profile@<build>.timing.json (the two stages share one
server per build: whichever runs first starts it, measures and scores). `--limit` caps docs per task
(params evaluate.harness.limit, 0 = every doc); the share of server time spent starting grows as it shrinks.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from benchmarks.common import measure, path_arg, report, scratch_project, stage_timing, stages
from quantgate.errors import QuantgateError, run_main


def run_stage(project: Path, stage: str) -> dict:
    """Run one stage in `project`; return {wall_s, peak_rss_gib, server_start_s, scoring_s} and, for a server
    stage (benchmarks.common.stage_timing), profile_s.

    Raises QuantgateError naming the stage and the log's last lines if it fails.
    """
    m = measure(["dvc", "repro", "--single-item", stage], project)
    if m.rc != 0:
        tail = "\n".join(m.output.strip().splitlines()[-15:])
        raise QuantgateError(f"stage {stage} failed ({m.rc}) in {project}:\n{tail}")
    row = {"wall_s": m.wall_s, "peak_rss_gib": m.peak_rss_gib, "server_start_s": None, "scoring_s": None}
    if timing := stage_timing(project, stage):
        row["server_start_s"] = timing["server_start_s"]
        measured = timing.get("profile_s")  # a failed measurement (profile_failed_s) cost its time too
        row["profile_s"] = measured if measured is not None else timing.get("profile_failed_s")
        row["scoring_s"] = round(sum(timing["scoring_s"].values()), 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(prog="benchmarks.pipeline_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=12, help="docs per task (evaluate.harness.limit); 0 = all")
    ap.add_argument("--work", type=path_arg, default=None, help="folder for the scratch project (default: a temp dir)")
    args = ap.parse_args()
    if args.limit < 0:
        raise QuantgateError(f"--limit must be >= 0 (0 = every doc), got {args.limit}")
    work = args.work or Path(tempfile.mkdtemp(prefix="quantgate-bench-"))
    project = scratch_project(work / "pipeline_cost", limit=args.limit or None)
    names = stages(project)
    runs = {}
    for phase in ("cold", "warm"):
        if phase == "warm":
            for out in ("models", "results"):
                shutil.rmtree(project / out)
        for stage in names:
            runs[phase, stage] = run_stage(project, stage)
            print(f"{phase} {stage}: {runs[phase, stage]['wall_s']} s", flush=True)
    rows = []
    for stage in names:
        c, w = runs["cold", stage], runs["warm", stage]
        rows.append(
            {
                "stage": stage,
                "cold s": c["wall_s"],
                "cold GiB": c["peak_rss_gib"],
                "cold server start s": c["server_start_s"],
                "cold profile s": c.get("profile_s"),
                "cold scoring s": c["scoring_s"],
                "warm s": w["wall_s"],
                "warm GiB": w["peak_rss_gib"],
            }
        )
    total = {p: round(sum(runs[p, s]["wall_s"] for s in names), 1) for p in ("cold", "warm")}
    rows.append(
        {
            "stage": "total",
            "cold s": total["cold"],
            "cold GiB": max(r["cold GiB"] for r in rows),
            "cold server start s": None,
            "cold profile s": None,
            "cold scoring s": None,
            "warm s": total["warm"],
            "warm GiB": max(r["warm GiB"] for r in rows),
        }
    )
    start = sum(runs["cold", s]["server_start_s"] or 0 for s in names)
    measuring = sum(runs["cold", s].get("profile_s") or 0 for s in names)
    scoring = sum(runs["cold", s]["scoring_s"] or 0 for s in names)
    served = start + measuring + scoring
    starts = sum(1 for s in names if runs["cold", s]["server_start_s"])
    notes = [
        f"cold evaluate and profile: {starts} vLLM servers, {start:.0f} s starting them, {measuring:.0f} s "
        f"measuring, {scoring:.0f} s scoring ({100 * start / served:.0f} % of their server time is start-up)"
        if served
        else "no evaluate or profile stage started a server",
        "warm: outputs deleted; prepare/quantize restored from the DVC run-cache, evaluate and profile from "
        "their content caches (no server started)",
        f"limit = {args.limit or 'all'} docs per task; project in {project}",
    ]
    report(
        "pipeline_cost",
        "dvc repro per stage, default model (wall s, peak RSS GiB of the stage's process tree)",
        rows,
        meta={"limit": args.limit or None, "project": str(project)},
        notes=notes,
    )


if __name__ == "__main__":
    run_main(main)
