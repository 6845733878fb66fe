"""Stage `validate`: check every team eval set before anything else runs.

Run by DVC: `python -m pipeline.validate EVALS_DIR OUT_JSON` (first stage in dvc.yaml).

A bad eval set stops `dvc repro` here, with every problem named (team, file:line, fix),
before any build is prepared, evaluated or registered, so no team's results and no registry
entry are touched. A team's optional calibration conversations (`evals/<team>/calibration.jsonl`) are
checked as the calibrate stage checks them (quantgate/calibration.py): one conversation per line, none
containing any team's eval document. On success it writes a summary of the teams (policy, tasks,
document counts, folder digests) that the report and the registry read.
"""

from __future__ import annotations

import sys
from pathlib import Path

from quantgate.budget import ValidateParams, check_budget_teams, load_budgets
from quantgate.calibration import CHECKED, team_conversations
from quantgate.errors import QuantgateError, run_main
from quantgate.params import BASELINE_BUILD, PARAMS_FILE, load_block, load_builds, read_yaml
from quantgate.results import TeamSummary, write_teams
from quantgate.search_params import SEARCH_RECIPE, SearchParams, check_base
from quantgate.teams import POLICY_FILE, Team, load_teams, min_docs


def summary(teams: list[Team], budgets: ValidateParams) -> dict[str, TeamSummary]:
    """{team: TeamSummary} (results/teams.json).

    min_docs is the fewest documents with which identical builds can PASS (0/1 metrics,
    quantgate/checks.py), None for continuous metrics; cost is the set's estimated cost per build
    (quantgate/budget.py), budget what validate checked it against.
    """
    out = {}
    for t in teams:
        p = t.policy
        cost = t.cost
        out[t.name] = TeamSummary(
            owner=p.owner,
            contact=p.contact,
            metric=p.metric,
            higher_is_better=p.higher_is_better,
            margin=p.margin.model_dump(exclude_none=True),
            confidence=p.confidence,
            n_docs=sum(x.n_docs for x in t.tasks),
            min_docs=min_docs(p),
            tasks={x.name: x.n_docs for x in t.tasks},
            sha256=t.digest,
            cost={
                "documents": cost.documents,
                "prompt_tokens": cost.prompt_tokens,
                "generated_tokens": cost.generated_tokens,
            },
            budget=budgets.for_team(t.name).model_dump(),
        )
    return out


def check_search(builds: list[str], path: Path = PARAMS_FILE) -> None:
    """Raise QuantgateError unless params.yaml's `search` block reads as the search stage reads it (every key,
    SearchParams) and exactly the build named by `search.build` reads the search's recipe: when that build is
    in `builds`, its quantize block's recipe is SEARCH_RECIPE, and no other build's is; and `search.base` is a
    quantized build of this run, made with `search.recipe` when the search runs (check_base)."""
    data = read_yaml(path)
    if not isinstance(data.get("search"), dict) or data["search"].get("base") is None:
        raise QuantgateError(
            f"{path}: search.base is missing (dvc.yaml's search stage names results/profile/${{search.base}}.json): "
            "set it to the build made with search.recipe (int4 by default)"
        )
    p = load_block("search", SearchParams, path)
    quantize = data.get("quantize") or {}
    readers = [b for b, q in quantize.items() if isinstance(q, dict) and q.get("recipe") == SEARCH_RECIPE]
    if stray := [b for b in readers if b != p.build]:
        raise QuantgateError(
            f"{path}: quantize.{stray[0]}.recipe is {SEARCH_RECIPE}, which the search writes for search.build "
            f"({p.build}) only; set search.build: {stray[0]} or give quantize.{stray[0]} its own recipe"
        )
    if p.build in builds and p.build not in readers:
        raise QuantgateError(
            f"{path}: search.build {p.build} is a build, so quantize.{p.build}.recipe must be {SEARCH_RECIPE} "
            "(the search stage writes it)"
        )
    # dvc.yaml's search stage reads results/profile/<search.base>.json whether or not the search runs
    if p.base not in builds or (p.base == BASELINE_BUILD and p.build in builds):
        why = f"{p.base} is the 16-bit build" if p.base == BASELINE_BUILD else f"{p.base} is not in builds"
        raise QuantgateError(
            f"{path}: search.base {why}: it names the quantized build whose profile, with fp16's, prices the "
            "search's candidates (a dependency of the search stage even when the search is skipped); set it to the "
            "build made with search.recipe (int4 by default), or to any build of this run when search.build is not one"
        )
    if p.build in builds:
        check_base(p, quantize, path)


def main() -> None:
    if len(sys.argv) != 3:
        raise QuantgateError("usage: python -m pipeline.validate EVALS_DIR OUT_JSON")
    evals_dir, out_json = map(Path, sys.argv[1:])
    if out_json.is_dir():
        raise QuantgateError(f"{out_json} is a folder; give the JSON file to write")
    builds = load_builds()  # builds and quantize blocks agree, before any stage builds anything
    check_search(builds)
    budgets = load_budgets()
    if evals_dir.is_dir():
        check_budget_teams(budgets, sorted(p.name for p in evals_dir.iterdir() if (p / POLICY_FILE).is_file()))
    loaded = load_teams(evals_dir, budgets=budgets)
    own = team_conversations(loaded)
    teams = summary(loaded, budgets)
    write_teams(out_json, teams)
    print(f"validate: builds {', '.join(builds)}: each quantized build has its quantize block")
    for t in loaded:
        s = teams[t.name]
        print(f"validate: {t.name}: ok, {s.n_docs} docs, metric {s.metric}, owner {s.owner}; per build {t.cost.line()}")
    if own:
        print(f"validate: {len(own)} team calibration conversations: ok, {CHECKED}")


if __name__ == "__main__":
    run_main(main, log="validate")
