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

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from quantgate.budget import ValidateParams, check_budget_teams, load_budgets
from quantgate.calibrate_params import CalibrateParams, load_prompts, made_with
from quantgate.calibration import CHECKED, team_conversations
from quantgate.cost import CostParams, check_max_model_len
from quantgate.errors import QuantgateError, run_main
from quantgate.evaluate_params import EvaluateParams, check_endpoint_builds
from quantgate.executor import ExecutorParams, cluster_address
from quantgate.judging import GateBlock
from quantgate.params import BASELINE_BUILD, PARAMS_FILE, load_block, load_builds, read_yaml, where
from quantgate.precision import python_problem
from quantgate.prepare_params import PrepareParams, check_source, source_context
from quantgate.profile_params import ProfileParams
from quantgate.quantize_params import QuantizeParams
from quantgate.recipes import check_calibration, declared_schemes, least_bits_per_weight, load_recipe, weight_schemes
from quantgate.recorded import settings_problem
from quantgate.register_params import RegisterParams
from quantgate.results import TeamSummary, write_teams
from quantgate.search_params import SEARCH_RECIPE, SearchParams, check_base, same_path
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


def check_search(builds: list[str], path: Path = PARAMS_FILE) -> SearchParams:
    """The `search` block, read as the search stage reads it (every key, SearchParams), once its pairing with
    the quantize blocks holds: exactly the build named by `search.build` reads the search's recipe (when that
    build is in `builds`, its quantize block's recipe is SEARCH_RECIPE, and no other build's is); the search
    falls back from a recipe of its own, not from the one it writes; and `search.base` is a quantized build of
    this run, made with `search.recipe` and not served as W4A8 when the search runs (check_base), nor is the
    build the search writes (it screens at 16-bit activations). dvc.yaml interpolates search.base
    and search.recipe, so both must be written. Raises QuantgateError naming `path` and the key."""
    data = read_yaml(path)
    raw = data.get("search")
    for key, what in (("base", "the build made with search.recipe (int4 by default)"), ("recipe", "recipes/int4.yaml")):
        if not isinstance(raw, dict) or not isinstance(raw.get(key), str) or not raw[key]:
            at = where(path, f"search.{key}")
            raise QuantgateError(
                f"{at}: search.{key} is missing (dvc.yaml's search stage reads ${{search.{key}}}); set it, "
                f"e.g. to {what}"
            )
    p = load_block("search", SearchParams, path)
    if p.build == BASELINE_BUILD:
        at = where(path, "search.build")
        raise QuantgateError(
            f"{at}: search.build is {BASELINE_BUILD}, the 16-bit build prepare makes, which no recipe makes; name "
            "the quantized build whose recipe the search writes (int4-mixed by default)"
        )
    quantize = data.get("quantize") or {}
    readers = [b for b, q in quantize.items() if isinstance(q, dict) and same_path(q.get("recipe"), SEARCH_RECIPE)]
    if stray := [b for b in readers if b != p.build]:
        at = where(path, f"quantize.{stray[0]}.recipe")
        raise QuantgateError(
            f"{at}: quantize.{stray[0]}.recipe is {SEARCH_RECIPE}, which the search writes for search.build "
            f"({p.build}) only; "
            + (  # search.build's own block reads it too: switching search.build alone moves the clash there
                f"give quantize.{stray[0]} its own recipe (to search for {stray[0]} instead, also give "
                f"quantize.{p.build} its own and set search.build: {stray[0]})"
                if p.build in readers
                else f"set search.build: {stray[0]} or give quantize.{stray[0]} its own recipe"
            )
        )
    if p.build in builds and p.build not in readers:
        at = where(path, f"quantize.{p.build}.recipe")
        raise QuantgateError(
            f"{at}: search.build {p.build} is a build, so quantize.{p.build}.recipe must be {SEARCH_RECIPE} "
            "(the search stage writes it)"
        )
    if same_path(p.recipe, SEARCH_RECIPE) or p.base == p.build:
        at = where(path, "search.recipe" if same_path(p.recipe, SEARCH_RECIPE) else "search.base")
        raise QuantgateError(
            f"{at}: the search "
            "falls back from search.recipe (made as search.base), so neither can be what it "
            f"writes ({SEARCH_RECIPE}, search.build {p.build}); set search.recipe: recipes/int4.yaml and "
            "search.base: int4"
        )
    # dvc.yaml's search stage reads results/profile/<search.base>.json whether or not the search runs
    if p.base not in builds or (p.base == BASELINE_BUILD and p.build in builds):
        why = f"{p.base} is the 16-bit build" if p.base == BASELINE_BUILD else f"{p.base} is not in builds"
        at = where(path, "search.base")
        raise QuantgateError(
            f"{at}: search.base {why}: it names the quantized build whose profile, with fp16's, prices the "
            "search's candidates (a dependency of the search stage even when the search is skipped); set it to the "
            "build made with search.recipe (int4 by default), or to any build of this run when search.build is not one"
        )
    if not Path(p.recipe).is_file():  # a dep of the search stage (dvc.yaml) even when the search is skipped
        at = where(path, "search.recipe")
        raise QuantgateError(
            f"{at}: search.recipe {p.recipe}: no such file; name the recipe {p.build} falls back from "
            "(recipes/int4.yaml by default)"
        )
    if p.build in builds:
        check_base(p, quantize, path)
        check_bits_bound(p, path)
        if isinstance(quantize.get(p.build), dict) and quantize[p.build].get("w4a8") is True:
            raise QuantgateError(
                f"{where(path, f'quantize.{p.build}.w4a8')}: quantize.{p.build}.w4a8: the search screens "
                f"{p.build}'s candidates at 16-bit activations and prices them with search.base's W4A16 profile, so "
                f"it cannot make a W4A8 build; drop w4a8 here (a W4A8 build of int4's recipe is a build of its own: "
                "docs/machines.md)"
            )
    return p


def check_bits_bound(p: SearchParams, path: Path = PARAMS_FILE) -> None:
    """Raise QuantgateError when search.max_bits_per_weight is below the fewest bits per weight search.recipe's
    weight scheme stores (recipes.least_bits_per_weight: 4.25 for W4A16 at group size 64), the bound the search
    would refuse only after quantize and profile (search.top_units, with the model's layer widths). A recipe
    that does not parse, or quantizes no weights, is left to check_quantize and the search, which name it."""
    if p.max_bits_per_weight is None:
        return
    try:
        with llm_compressor_quiet():
            recipe = load_recipe(p.base, Path(p.recipe), "search.recipe")
    except QuantgateError:
        return
    schemes = [s for s, _ in weight_schemes(recipe) if s.weights is not None]
    if schemes and (floor := least_bits_per_weight(schemes[0].weights)) > p.max_bits_per_weight:
        raise QuantgateError(
            f"{where(path, 'search.max_bits_per_weight')}: search.max_bits_per_weight {p.max_bits_per_weight:g} is "
            f"below the {floor:.2f} bits per weight search.recipe {p.recipe} stores for every layer it quantizes, so "
            f"no candidate of {p.build} fits; raise it above {floor:.2f}, or set it to null for no bound"
        )


W4A16_SCHEMES = ("W4A16", "W4A16_ASYM")  # llm-compressor's presets, and config groups read as W4A16


def check_quantize(builds: list[str], path: Path = PARAMS_FILE) -> dict[str, QuantizeParams]:
    """{build: its quantize block} for every quantized build, each read as the quantize stage reads it
    (QuantizeParams: every key), its recipe an existing file (but the search's, which the search writes), and
    W4A16 where the block sets w4a8 (as far as the YAML declares its schemes: recipes.declared_schemes), and
    the recipe one the quantize stage can run with the block's calibration (check_recipe).
    Raises QuantgateError naming `path`, the line and the key."""
    blocks = {b: load_block(f"quantize.{b}", QuantizeParams, path) for b in builds if b != BASELINE_BUILD}
    for b, q in blocks.items():
        if same_path(q.recipe, SEARCH_RECIPE):
            continue
        if not Path(q.recipe).is_file():
            at = where(path, f"quantize.{b}.recipe")
            raise QuantgateError(
                f"{at}: quantize.{b}.recipe {q.recipe}: no such file; add the recipe under recipes/ or fix the path"
            )
        if q.w4a8 and (other := [s for s in declared_schemes(Path(q.recipe)) if s.upper() not in W4A16_SCHEMES]):
            raise QuantgateError(
                f"{where(path, f'quantize.{b}.w4a8')}: quantize.{b}.w4a8: true serves W4A16 weights (4-bit, 16-bit "
                f"activations) as W4A8, and {q.recipe} declares {other[0]}; give the block a W4A16 recipe such as "
                "recipes/int4.yaml (the int8 activations come from vLLM at serving, not from the recipe), or drop w4a8"
            )
        check_recipe(b, q, path)
    return blocks


@contextlib.contextmanager
def llm_compressor_quiet() -> Iterator[None]:
    """llm-compressor's log lines off while validate parses recipes with it: validate's log is shown whole with
    any error, and those lines ("No accelerator available! Compressing model on CPU instead") say nothing of
    params.yaml. Its logger reads LLM_COMPRESSOR_LOG_DISABLED when llm-compressor is imported, here or later."""
    from loguru import logger

    before = os.environ.get("LLM_COMPRESSOR_LOG_DISABLED")
    os.environ["LLM_COMPRESSOR_LOG_DISABLED"] = "true"
    logger.disable("llmcompressor")
    try:
        yield
    finally:
        logger.enable("llmcompressor")
        try:  # llm-compressor adds its METRIC level only when imported with logging on; it logs at it later
            logger.level("METRIC")
        except ValueError:
            logger.level("METRIC", no=38)  # llmcompressor/logger.py configure_logger's number
        if before is None:
            del os.environ["LLM_COMPRESSOR_LOG_DISABLED"]
        else:
            os.environ["LLM_COMPRESSOR_LOG_DISABLED"] = before


def check_recipe(build: str, q: QuantizeParams, path: Path = PARAMS_FILE) -> None:
    """Raise QuantgateError unless quantize.<build>.recipe parses as the quantize stage parses it (load_recipe:
    llm-compressor's Recipe) and its calibration suits it (check_calibration: a block for a recipe that needs
    data, the sequential pipeline for a modifier that needs it), naming `path`, the line and the key."""
    try:
        with llm_compressor_quiet():
            recipe = load_recipe(build, Path(q.recipe))
    except QuantgateError as exc:
        raise QuantgateError(
            f"{where(path, f'quantize.{build}.recipe')}: quantize.{build}.recipe {q.recipe} is not an llm-compressor "
            f"recipe: {exc}; name one under recipes/ (recipes/README.md)"
        ) from None
    at = f"quantize.{build}.calibration" + (".pipeline" if q.calibration else "")
    check_calibration(build, recipe, Path(q.recipe), q.calibration, where(path, at))


def check_prepare(path: Path = PARAMS_FILE) -> PrepareParams:
    """The `prepare` block as the prepare stage reads it (PrepareParams: every key), its source one prepare can
    load (check_source: the builtin model installed, or a Hugging Face model directory). Raises QuantgateError
    naming `path`, the line and the key."""
    p = load_block("prepare", PrepareParams, path)
    try:
        check_source(p)
    except QuantgateError as exc:
        raise QuantgateError(f"{where(path, 'prepare.source')}: {exc}") from None
    return p


def check_context_length(prepare: PrepareParams, evaluate: EvaluateParams, path: Path = PARAMS_FILE) -> None:
    """Raise QuantgateError when evaluate.serve.max_model_len (tokens; -1, what fits, is not checked) is longer
    than the context the model at prepare.source declares (source_context): vLLM refuses to start a server
    with it, which once surfaced at the first server, after every build was made."""
    length = evaluate.serve.max_model_len
    context, source = source_context(prepare)
    if context is not None and length > context:
        raise QuantgateError(
            f"{where(path, 'evaluate.serve.max_model_len')}: evaluate.serve.max_model_len {length} is longer than "
            f"the model's context ({context} tokens, {source}); vLLM would refuse to start: lower it to {context} "
            "or less, or -1 for what fits"
        )


def check_calibrate(path: Path = PARAMS_FILE) -> CalibrateParams:
    """The `calibrate` block as the calibrate stage reads it (CalibrateParams: every key), its prompt file an
    existing, well-formed prompt set (load_prompts). Read before the counts asked of it, so that a bad
    calibrate.samples is named as itself. Raises QuantgateError naming `path`, the line and the key (or the
    prompt file and its field), or when the recorded calibration set (calibrate.recorded) was made with other
    settings than these: the calibrate stage would refuse it after prepare."""
    p = load_block("calibrate", CalibrateParams, path)
    if not Path(p.prompts).is_file():
        raise QuantgateError(
            f"{where(path, 'calibrate.prompts')}: calibrate.prompts {p.prompts}: no such file; name the prompt set "
            "(recipes/calibration/prompts.yaml by default) or fix the path"
        )
    try:
        prompts = load_prompts(Path(p.prompts))
    except QuantgateError as exc:  # the file's own line and field, and the key that named the file
        raise QuantgateError(f"{where(path, 'calibrate.prompts')}: calibrate.prompts {p.prompts}: {exc}") from None
    if problem := settings_problem(Path(p.recorded), made_with(p, prompts)):
        raise QuantgateError(f"{where(path, 'calibrate')}: calibrate: {problem}")
    return p


def check_samples(
    search: SearchParams, blocks: dict[str, QuantizeParams], calibrate: CalibrateParams, path: Path = PARAMS_FILE
) -> None:
    """Raise QuantgateError unless every count of calibration conversations asked for (quantize.<build>.calibration
    .samples, search.kl_samples) fits in the calibrate stage's file, which holds calibrate.samples of them."""
    have = calibrate.samples
    asks = {f"quantize.{b}.calibration.samples": q.calibration.samples for b, q in blocks.items() if q.calibration}
    if search.build in blocks:
        asks["search.kl_samples"] = search.kl_samples
    if over := {k: n for k, n in asks.items() if n > have}:
        key, n = next(iter(over.items()))
        at = where(path, key)
        raise QuantgateError(
            f"{at}: {key} asks for {n} calibration conversations, but results/calibration.jsonl holds "
            f"calibrate.samples = {have}; lower {key} or raise calibrate.samples"
        )


def check_evaluate(builds: list[str], path: Path = PARAMS_FILE) -> EvaluateParams:
    """The `evaluate` block as the evaluate stage reads it (and profile, search and the gateway read its `serve`
    and `harness`), with its endpoints naming builds of this run: a bad field (`max_slowdown: fast`,
    `dtype: bf16`, an endpoint URL) stops the run here, before a build is made, not at the first server.

    Raises QuantgateError naming params.yaml, the line where the parse found one, and the field."""
    params = load_block("evaluate", EvaluateParams, path)
    check_endpoint_builds(params, builds, path)
    return params


FIND_VLLM = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"


def check_serving_python(evaluate: EvaluateParams, path: Path = PARAMS_FILE) -> None:
    """Raise QuantgateError, naming `path`, the line and the fix, unless evaluate.serve.python is an interpreter
    this machine can run: every build's profile, the search and `make calibration` start their vLLM servers here
    (a Ray node runs its own install's), and a missing one failed only at the first server."""
    python = evaluate.serve.python
    if (problem := python_problem(python)) is None:
        # vLLM found, not imported (that takes seconds; the platform probe does it once, later)
        found = subprocess.run([python, "-c", FIND_VLLM], capture_output=True, timeout=60, check=False)
        problem = None if found.returncode == 0 else "cannot import vllm (no such module there)"
    if problem:
        raise QuantgateError(
            f"{where(path, 'evaluate.serve.python')}: evaluate.serve.python {python} {problem}; run "
            "`make setup` (it makes the serving env, .venv-serve) or fix the path"
        )


def check_later_blocks(evaluate: EvaluateParams, path: Path = PARAMS_FILE) -> None:
    """The `gate`, `cost`, `executor`, `profile` and `register` blocks as the search, gate, serving, profile and
    register stages read them: a typo there stops the run here, not after the builds are made and scored
    (`prepare` is check_prepare's).

    A profile request (`input_len` + `output_len` tokens) must fit `evaluate.serve.max_model_len` (when it is set:
    -1 is the length vLLM fits), or the server refuses every benchmark request; so must the request the cost
    model prices (`cost.context_tokens`), which the gate checks against the server it profiled.

    Raises QuantgateError naming params.yaml, the line where the parse found one, and the field."""
    load_block("gate", GateBlock, path)
    cost = load_block("cost", CostParams, path)
    executor = load_block("executor", ExecutorParams, path)
    if executor.kind == "ray":
        try:
            cluster_address(executor)
        except QuantgateError as exc:
            raise QuantgateError(f"{where(path, 'executor.address')}: {exc}") from None
    profile = load_block("profile", ProfileParams, path)
    load_block("register", RegisterParams, path)
    limit = evaluate.serve.max_model_len
    if limit > 0 and profile.input_len + profile.output_len > limit:
        raise QuantgateError(
            f"{where(path, 'profile.input_len')}: profile.input_len: input_len + output_len = "
            f"{profile.input_len + profile.output_len} tokens, over evaluate.serve.max_model_len {limit}: vLLM would "
            "refuse every benchmark request; lower them or raise max_model_len"
        )
    check_max_model_len(cost, limit, f"{where(path, 'cost.context_tokens')}: cost.context_tokens")


def check_calibration_supply(own: int, calibrate: CalibrateParams, path: Path = PARAMS_FILE) -> None:
    """Raise QuantgateError when calibrate.samples asks for more conversations than can exist: the teams' own
    (`own`) plus every line of the recorded set (<calibrate.recorded>.jsonl). An upper bound: the calibrate stage
    also leaves out recorded answers that quote an eval document or are short, and refuses then."""
    recorded = Path(calibrate.recorded + ".jsonl")
    if not recorded.is_file():
        return  # the calibrate stage says how to record it
    lines = sum(1 for line in recorded.read_text(errors="replace").splitlines() if line.strip())
    if (n := calibrate.samples) > own + lines:
        raise QuantgateError(
            f"{where(path, 'calibrate.samples')}: calibrate.samples {n} asks for more calibration conversations than "
            f"there are: {own} of the teams' own and {lines} recorded in {recorded}; lower it to {own + lines} or "
            "fewer, or record more with `make calibration`"
        )


def check_doc_budget(search: SearchParams, teams: list[Team], builds: list[str], path: Path = PARAMS_FILE) -> None:
    """Raise QuantgateError when the search runs (search.build in `builds`) and search.doc_budget cannot pay for
    one look at every team: search.looks[0] documents per task (fewer where a task has fewer, after its team's
    `limit:`), the first look of the first screen (quantgate.screening.sequential). The search sets its own
    document limits, so evaluate.harness.limit does not count here."""
    if search.build not in builds:
        return
    per_task = search.looks[0]
    need = sum(min(per_task, task.n_docs) for t in teams for task in t.tasks)
    if search.doc_budget < need:
        at = where(path, "search.doc_budget")
        raise QuantgateError(
            f"{at}: search.doc_budget {search.doc_budget} cannot pay for one look at every team: {need} documents "
            f"({per_task} per task, search.looks[0]); raise it to {need} or more (a screen that runs out of budget "
            "decides nothing)"
        )


def main() -> None:
    if len(sys.argv) != 3:
        raise QuantgateError("usage: python -m pipeline.validate EVALS_DIR OUT_JSON")
    evals_dir, out_json = map(Path, sys.argv[1:])
    if out_json.is_dir():
        raise QuantgateError(f"{out_json} is a folder; give the JSON file to write")
    builds = load_builds()  # builds and quantize blocks agree, before any stage builds anything
    prepare = check_prepare()
    calibrate = check_calibrate()  # before the counts asked of it: a bad calibrate.samples is named as itself
    blocks = check_quantize(builds)  # a recipe file that is missing is named as such
    search = check_search(builds)
    check_samples(search, blocks, calibrate)
    evaluate = check_evaluate(builds)
    check_context_length(prepare, evaluate)
    check_serving_python(evaluate)
    check_later_blocks(evaluate)
    budgets = load_budgets()
    if evals_dir.is_dir():
        check_budget_teams(budgets, sorted(p.name for p in evals_dir.iterdir() if (p / POLICY_FILE).is_file()))
    loaded = load_teams(evals_dir, budgets=budgets)
    own = team_conversations(loaded)
    check_calibration_supply(len(own), calibrate)
    check_doc_budget(search, loaded, builds)
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
