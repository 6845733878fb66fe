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
from quantgate.params import BASELINE_BUILD, PARAMS_FILE, load_builds, read_yaml
from quantgate.results import TeamSummary, write_teams
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


SEARCH_RECIPE = "results/search/recipe.yaml"  # the search stage's out (dvc.yaml), int4-mixed's recipe
DEFAULT_SEARCH_RECIPE = "recipes/int4.yaml"  # pipeline.search.SearchParams.recipe's default


def check_search(builds: list[str], path: Path = PARAMS_FILE) -> None:
    """Raise QuantgateError unless exactly the build named by `search.build` reads the search's recipe:
    when that build is in `builds`, its quantize block's recipe is SEARCH_RECIPE, and no other build's is;
    and that `search.base` is a quantized build of this run, made with `search.recipe` when the search runs."""
    data = read_yaml(path)
    search = data.get("search") or {}
    target = search.get("build")
    readers = [
        b for b, q in (data.get("quantize") or {}).items() if isinstance(q, dict) and q.get("recipe") == SEARCH_RECIPE
    ]
    if stray := [b for b in readers if b != target]:
        raise QuantgateError(
            f"{path}: quantize.{stray[0]}.recipe is {SEARCH_RECIPE}, which the search writes for search.build "
            f"({target}) only; set search.build: {stray[0]} or give quantize.{stray[0]} its own recipe"
        )
    if target in builds and target not in readers:
        raise QuantgateError(
            f"{path}: search.build {target} is a build, so quantize.{target}.recipe must be {SEARCH_RECIPE} "
            "(the search stage writes it)"
        )
    base = search.get("base")
    # dvc.yaml's search stage reads results/profile/<search.base>.json whether or not the search runs
    if not isinstance(base, str) or base not in builds or (base == BASELINE_BUILD and target in builds):
        why = (
            "is missing (dvc.yaml's search stage names results/profile/${search.base}.json)"
            if base is None
            else f"{base} is the 16-bit build"
            if base == BASELINE_BUILD
            else f"{base} is not in builds"
        )
        raise QuantgateError(
            f"{path}: search.base {why}: it names the quantized build whose profile, with fp16's, prices the "
            "search's candidates (a dependency of the search stage even when the search is skipped); set it to the "
            "build made with search.recipe (int4 by default), or to any build of this run when search.build is not one"
        )
    recipe = search.get("recipe", DEFAULT_SEARCH_RECIPE)
    made_with = ((data.get("quantize") or {}).get(base) or {}).get("recipe")
    if target in builds and (made_with is None or Path(made_with) != Path(recipe)):
        raise QuantgateError(
            f"{path}: search.base {base} is made with {made_with} (quantize.{base}.recipe), not with "
            f"search.recipe {recipe}; name the build made with the recipe the search falls back from"
        )


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
