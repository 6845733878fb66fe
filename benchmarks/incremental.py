"""Question 2: what does a re-run cost after a small change, with 3 and with 12 teams?

    .venv/bin/python -m benchmarks.incremental [--teams 3,12] [--limit 12] [--work DIR | --project DIR]
        [--scenarios abcde]

In a scratch copy of this working tree (benchmarks.common.scratch_project) it runs
`dvc repro` once, then measures `dvc repro` after each change:
  (a) no change;
  (b) one team's data changed (one question of the search team gets a new revision mark);
  (c) one new team added (a synthetic team; it stays, so (d) runs with one team more);
  (d) one quantization parameter changed (quantize.int4.calibration.samples, to a value new here),
  (d') and changed back: DVC restores the earlier outputs from its run-cache;
  (e) one team's margin changed (search, margin.absolute to a value new here): the evaluate
      and profile stages re-run (evals/ is their dep) but find every team and profile in the
      content caches, so no vLLM server starts ("teams scored" is "-") and only gate and
      register do real work.
The extra teams for 12 are synthetic copies of the search team (own task name, its
documents rotated so each team scores different ones), committed like a real submission.

"one team's eval" is what evaluating that team alone costs: on every build, starting its
server plus scoring that team (from the timing of the stage that scored it: evaluate@<build>, or
profile@<build> when it ran first and scored the teams on the build's one server, benchmarks.common.stage_timing).
The target (issue 6): (a) under 10 s; (b) and (c) under 1.5x one team's eval,
i.e. the other teams come from the evaluation cache and validate/gate/register are cheap;
(issue 13) (e) scores no team.
Columns: teams in the project, the scenario, wall s of `dvc repro`, how many stages DVC
ran, the teams scored (not from the evaluation cache), one team's eval (s, see above) and
the ratio of the two.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import yaml

from benchmarks.common import REPO, commit, is_scratch_project, measure, path_arg, report, scratch_project, stage_timing
from quantgate.errors import QuantgateError, run_main

TEMPLATE = "search"  # team copied for synthetic teams
BUILDS = ("fp16", "fp8", "int4")


def repro(project: Path) -> dict:
    """Run `dvc repro`; return {wall_s, stages run, teams scored, per-team eval cost (s)}.

    Raises QuantgateError with the log's last lines if it fails.
    """
    m = measure(["dvc", "repro"], project)
    if m.rc != 0:
        tail = "\n".join(m.output.strip().splitlines()[-15:])
        raise QuantgateError(f"dvc repro failed ({m.rc}) in {project}:\n{tail}")
    ran = re.findall(r"Running stage '([^']+)'", m.output)
    start, scoring = 0.0, {}
    for build in BUILDS:  # the timing of a stage DVC did not run is from an earlier run
        for stage in (f"profile@{build}", f"evaluate@{build}"):  # one server per build: either may score
            if stage in ran and (timing := stage_timing(project, stage)):
                start += timing["server_start_s"]
                for team, s in timing["scoring_s"].items():
                    scoring[team] = scoring.get(team, 0.0) + s
    one_team = {team: round(start + s, 1) for team, s in scoring.items()}
    return {"wall_s": m.wall_s, "stages": ran, "scored": sorted(scoring), "one_team_eval_s": one_team}


def add_team(project: Path, name: str, rotate: int) -> None:
    """Copy the template team to evals/<name> with its own task name and rotated documents."""
    src, dst = project / "evals" / TEMPLATE, project / "evals" / name
    shutil.copytree(src, dst)
    for task in dst.glob("*.yaml"):
        if task.name != "team.yaml":
            task.write_text(task.read_text().replace(f"task: {TEMPLATE}_", f"task: {name}_"))
    lines = (dst / "data.jsonl").read_text().splitlines()
    k = rotate % len(lines)
    (dst / "data.jsonl").write_text("\n".join(lines[k:] + lines[:k]) + "\n")


def set_param(project: Path, block: str, key: str, value) -> None:
    doc = yaml.safe_load((project / "params.yaml").read_text())
    node = doc
    for part in block.split("."):
        node = node[part]
    node[key] = value
    (project / "params.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def set_margin(project: Path, team: str, absolute: float) -> None:
    """Set evals/<team>/team.yaml's margin.absolute (a policy change: nothing to re-score)."""
    path = project / "evals" / team / "team.yaml"
    path.write_text(re.sub(r"(?m)^(  absolute: )[0-9.]+", rf"\g<1>{absolute}", path.read_text()))


def scenario(project: Path, label: str, teams: int, change, measured: list[dict], team: str | None = None) -> None:
    """Apply `change` (a function of the project), commit, measure `dvc repro`, add a row."""
    change(project)
    commit(project, label)
    r = repro(project)
    base = r["one_team_eval_s"].get(team) if team else None
    measured.append(
        {
            "teams": teams,
            "scenario": label,
            "wall s": r["wall_s"],
            "stages run": len(r["stages"]),
            "teams scored": ",".join(r["scored"]) or "-",
            "one team's eval s": base,
            "ratio": round(r["wall_s"] / base, 2) if base else None,
        }
    )
    print(f"{teams} teams, {label}: {r['wall_s']} s; ran {', '.join(r['stages']) or 'nothing'}", flush=True)


def revision(project: Path) -> int:
    """Commits in the project so far: a number no earlier change of this project used."""
    out = subprocess.run(["git", "rev-list", "--count", "HEAD"], cwd=project, capture_output=True, text=True)
    return int(out.stdout.strip() or 0)


def reword(project: Path, i: int) -> None:
    """Change document `i` of the search team (one team's data changed): its question gets a
    revision mark never used before in this project, so no cache can hold its results."""
    path = project / "evals" / "search" / "data.jsonl"
    lines = path.read_text().splitlines()
    doc = json.loads(lines[i])
    doc["question"] = f"{doc['question'].split(' (rev ')[0]} (rev {revision(project)})"
    lines[i] = json.dumps(doc)
    path.write_text("\n".join(lines) + "\n")


def n_teams(project: Path) -> int:
    return sum(1 for d in (project / "evals").iterdir() if (d / "team.yaml").is_file())


def main() -> None:
    ap = argparse.ArgumentParser(prog="benchmarks.incremental", description=__doc__.split("\n\n")[0])
    ap.add_argument("--teams", default="3,12", help="team counts, comma-separated, each >= the project's teams")
    where = ap.add_mutually_exclusive_group()
    where.add_argument(
        "--work", type=path_arg, default=None, help="folder for a new scratch project (default: a temp dir)"
    )
    where.add_argument(
        "--project",
        type=path_arg,
        default=None,
        help="reuse a scratch project (e.g. the one benchmarks.pipeline_cost made) instead of a new one",
    )
    ap.add_argument("--limit", type=int, default=None, help="docs per task of a new project (default 12)")
    ap.add_argument("--scenarios", default="abcde", help="which scenarios to measure, e.g. `e` (default: all)")
    args = ap.parse_args()
    if not args.scenarios or set(args.scenarios) - set("abcde"):
        raise QuantgateError(f"--scenarios {args.scenarios!r}: give letters from abcde, e.g. `e` or `abce`")
    try:
        counts = sorted({int(x) for x in args.teams.split(",")})
    except ValueError:
        raise QuantgateError(f"--teams {args.teams!r}: give team counts like 3,12") from None
    if args.project and args.limit is not None:
        raise QuantgateError("--limit applies to a new project only; --project keeps its own params.yaml")
    if args.limit is not None and args.limit < 1:
        raise QuantgateError(f"--limit must be >= 1, got {args.limit}")
    if args.project and not is_scratch_project(args.project):
        raise QuantgateError(
            f"--project {args.project}: not a scratch project made by benchmarks.pipeline_cost or "
            "this script (this benchmark commits changes there); omit --project to make one"
        )
    have = n_teams(args.project or REPO)
    if counts[0] < have:
        raise QuantgateError(f"--teams {args.teams!r}: every count must be >= {have} (the teams already there)")
    if args.project:
        project = args.project
    else:
        work = args.work or Path(tempfile.mkdtemp(prefix="quantgate-bench-"))
        project = scratch_project(work / "incremental", limit=args.limit or 12)
    first = repro(project)
    print(f"initial dvc repro ({n_teams(project)} teams): {first['wall_s']} s", flush=True)
    rows = []
    for i, n in enumerate(counts):
        have = n_teams(project)
        if n > have:  # grow with synthetic teams (not a measured scenario)
            for k in range(have + 1, n + 1):
                add_team(project, f"synth_{k:02d}", rotate=7 * k)
            commit(project, f"{n} teams")
            print(f"grown to {n} teams: {repro(project)['wall_s']} s", flush=True)
        if "a" in args.scenarios:
            scenario(project, "(a) no change", n, lambda p: None, rows)
        if "b" in args.scenarios:
            scenario(project, "(b) one team's data changed", n, lambda p, i=i: reword(p, i), rows, team="search")
        if "c" in args.scenarios:  # the new team stays: the next count grows from n + 1 teams
            scenario(
                project,
                "(c) one new team added",
                n,
                lambda p, n=n, i=i: add_team(p, f"new_{n:02d}", rotate=3 + i),
                rows,
                team=f"new_{n:02d}",
            )
        if "d" in args.scenarios:  # a value this project never used, so DVC's run-cache cannot hold it
            samples = 64 - revision(project) % 32
            scenario(
                project,
                f"(d) quantize.int4.calibration.samples 64 -> {samples}",
                n_teams(project),
                lambda p, samples=samples: set_param(p, "quantize.int4.calibration", "samples", samples),
                rows,
            )
            scenario(
                project,
                "(d') changed back (DVC run-cache)",
                n_teams(project),
                lambda p: set_param(p, "quantize.int4.calibration", "samples", 64),
                rows,
            )
        if "e" in args.scenarios:
            margin = round(0.05 + 0.001 * revision(project), 3)  # a margin this project never used
            scenario(
                project,
                f"(e) search margin.absolute -> {margin}",
                n_teams(project),
                lambda p, margin=margin: set_margin(p, "search", margin),
                rows,
            )
    notes = [
        f"initial dvc repro: {first['wall_s']} s; project in {project}",
        "ratio = wall s / one team's eval (that team alone on every build: server starts + its scoring)",
        "target: (a) < 10 s; (b), (c) < 1.5; (e) teams scored '-' (no vLLM server started)",
    ]
    report(
        "incremental",
        "dvc repro after one change (wall s)",
        rows,
        meta={"teams": counts, "project": str(project)},
        notes=notes,
    )


if __name__ == "__main__":
    run_main(main)
