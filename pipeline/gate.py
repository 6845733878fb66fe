"""Stage `gate`: a verdict per (build, team) and per build from paired per-sample scores.

Run by DVC: `python -m pipeline.gate EVAL_DIR EVALS_DIR METRICS_JSON REPORT_MD PLOT_PNG PROFILE_DIR COST_PNG COST_JSON
MODELS_DIR` (params blocks `gate`, `cost`, and `builds`).

For every candidate build and every team under evals/, the candidate's per-document scores
are paired with the baseline (16-bit) build's on the same documents and judged against the
team's non-inferiority margin (quantgate/stats.py). It fails closed: a missing result file,
an evaluation error, a different document set, or a NaN score is a FAIL with the reason.
A build is shippable only if every team PASSes.

Two builds with one weights digest (MODELS_DIR/<build>/build.json; a search that kept no layer 16-bit
makes int4-mixed int4's weights) are still judged apart, each on its own evidence; the later one's
`same_weights_as` names the first, and its report and gate line say so.

Beside the quality verdicts it prices each build's profile (PROFILE_DIR/<build>.json, the profile stage's)
with the `cost` block (pipeline/buys.py): the "what it buys" table in the report and gate.json's `buys`,
the quality-vs-cost plot (COST_PNG, and its data COST_JSON for `dvc plots`), and per candidate the
separate `recommended` field: PASS for every team AND cheaper per 1M output tokens than the baseline here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline import buys
from pipeline.plot import cost_plot, recovery_plot
from pipeline.report import table
from quantgate.budget import CHARS_PER_TOKEN, Cost
from quantgate.errors import QuantgateError, project_relative, run_main
from quantgate.judging import GateBlock, judge
from quantgate.manifest import SERVING_DEFAULTS, read_manifest, serving_settings
from quantgate.params import PARAMS_FILE, load_block, load_builds
from quantgate.precision import MACHINE_TABLE, WRONG, is_int8_w8a8
from quantgate.precision import RECORD as PRECISION
from quantgate.results import (
    SCORES,
    SEARCH_RESULT,
    BuildGate,
    GateResult,
    SearchResult,
    ServedPrecision,
    TeamComparison,
    TeamScores,
    read_scores,
    read_search,
    write_gate,
)
from quantgate.stats import (
    SEVERITY,
    Verdict,
    docs_for_power,
    pass_probability,
)
from quantgate.teams import Team, load_teams


class GateParams(GateBlock):
    """The gate block plus the builds it judges: every build of params.yaml `builds` but the baseline."""

    candidates: list[str] = ["fp8", "int4"]


def load_params(path: Path = PARAMS_FILE) -> GateParams:
    """GateParams from params.yaml: block `gate` (GateBlock refuses a baseline other than the 16-bit build),
    candidates from `builds`; raises QuantgateError naming the line of a bad field."""
    block, builds = load_block("gate", GateBlock, path), load_builds(path)
    return GateParams(**block.model_dump(), candidates=[b for b in builds if b != block.baseline])


def usable_scores(eval_dir: Path, build: str, team: str) -> TeamScores:
    """The scores of (build, team); raises QuantgateError (the FAIL reason) if unusable."""
    path = eval_dir / build / team / SCORES
    if not path.is_file():
        raise QuantgateError(f"no results for build {build} (missing {path}); run `dvc repro evaluate@{build}`")
    scores = read_scores(path)
    if scores.status != "ok":
        raise QuantgateError(f"build {build} evaluation error: {scores.reason or 'unknown'}")
    return scores


def read_precision(eval_dir: Path, build: str) -> ServedPrecision:
    """The precision record the evaluate stage wrote for `build` (results/eval/<build>/precision.json,
    quantgate/precision.py); raises QuantgateError (the FAIL reason) if it is missing or unreadable."""
    path = eval_dir / build / PRECISION
    try:
        doc = json.loads(path.read_text())
        return ServedPrecision(
            dtype=doc["dtype"],
            requested=doc.get("requested"),
            why=doc.get("why", ""),
            machine_kind=doc.get("machine_kind"),
        )
    except FileNotFoundError:
        raise QuantgateError(
            f"no precision record for build {build} (missing {path}); run `dvc repro evaluate@{build}`"
        ) from None
    except (ValueError, KeyError, TypeError):  # pydantic's ValidationError is a ValueError
        raise QuantgateError(
            f"{path}: not a precision record (needs dtype); run `dvc repro evaluate@{build}`"
        ) from None


def same_precision(eval_dir: Path, baseline: str, build: str) -> ServedPrecision:
    """The precision both builds were served at; raises QuantgateError (the FAIL reason) if it, or the
    kind of device they were scored on (precision.json `machine_kind`), differs: the gate compares builds,
    not activation dtypes or machines."""
    base, cand = read_precision(eval_dir, baseline), read_precision(eval_dir, build)
    if base.dtype != cand.dtype:
        raise QuantgateError(
            f"{baseline} was evaluated at {base.dtype} and {build} at {cand.dtype}: the gate "
            f"compares builds at one precision; re-run `dvc repro` so every build is evaluated at "
            f"evaluate.serve.dtype"
        )
    if base.machine_kind and cand.machine_kind and base.machine_kind != cand.machine_kind:
        raise QuantgateError(  # scores differ by kernel: a candidate must not win or lose by its machine
            f"{baseline} was evaluated on {base.machine_kind} and {build} on {cand.machine_kind}: the gate "
            "compares builds on one kind of device; evaluate every build on one kind (executor.resources "
            "naming those nodes) and re-run `dvc repro`"
        )
    return base


def inexact_kernel(eval_dir: Path, models_dir: Path, build: str, teams: list[Team]) -> str | None:
    """The platform probe's wrong answer for the int8 kernel `build` (an int8 W8A8 build) was served through at its
    dtype (results/eval/<build>/precision.json `w8a8`), where evaluate.serve.inexact_int8 served it anyway;
    None for any other build, an exact kernel, no record, or a build none of whose `teams` was scored (refused
    before any server: precision.json is written for it too, and nothing was served through that kernel)."""
    if not is_int8_w8a8(models_dir / build) or not any(scored(eval_dir, build, t.name) for t in teams):
        return None
    try:
        doc = json.loads((eval_dir / build / PRECISION).read_text())
        answer = doc["w8a8"][doc["dtype"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return answer if isinstance(answer, str) and answer.startswith(WRONG) else None


def scored(eval_dir: Path, build: str, team: str) -> bool:
    """Whether (build, team) has usable scores (usable_scores): it was served, here or in the evaluate cache."""
    try:
        usable_scores(eval_dir, build, team)
    except QuantgateError:
        return False
    return True


def search_of(search_file: Path | None) -> SearchResult | None:
    """The search stage's result at `search_file`, or None when there is none."""
    return read_search(search_file) if search_file is not None and search_file.is_file() else None


def weights_digests(models_dir: Path, builds: list[str]) -> dict[str, str]:
    """{build: weights digest} from each build's manifest (MODELS_DIR/<build>/build.json), in `builds` order,
    read, not re-hashed (register re-hashes); a build without a readable manifest is left out: this is a note
    for release managers, not evidence (its scores FAIL it where its weights are missing)."""
    out = {}
    for build in builds:
        try:
            out[build] = read_manifest(models_dir / build)["weights_digest"]
        except (QuantgateError, KeyError, TypeError):
            continue
    return out


def same_weights(digests: dict[str, str]) -> dict[str, str]:
    """{build: the first build before it in `digests` with the same digest}; a build with weights of its own
    is not a key."""
    first: dict[str, str] = {}
    for build, digest in digests.items():
        first.setdefault(digest, build)
    return {b: first[d] for b, d in digests.items() if first[d] != b}


def served_apart(model_dir: Path, twin_dir: Path) -> dict[str, str]:
    """The serving settings (quantgate.manifest.serving_settings) in which `model_dir` differs from its twin (the
    build with the same weights), as `model_dir` sets them, vLLM's default where it sets none: {"w4a8": "true"}
    for a W4A8 build of int4's weights, {"w4a8": "false"} for int4 beside a W4A8 build listed before it."""
    mine, theirs = serving_settings(model_dir), serving_settings(twin_dir)
    return {
        k: mine.get(k, SERVING_DEFAULTS[k]) for k in sorted(mine.keys() | theirs.keys()) if mine.get(k) != theirs.get(k)
    }


def same_weights_note(build: str, b: BuildGate, search: SearchResult | None) -> str | None:
    """The note "same weights as <build>" for a build that has another's weights, with why when its search (the
    search stage's result) kept no layer 16-bit or was skipped, and what it is served with that the other is not
    (", served with w4a8=true"); None for a build with weights of its own."""
    if not b.same_weights_as:
        return None
    why, own = "", search is not None and search.build == build
    if own and search.skipped:
        why = " (its search was skipped: no layer kept 16-bit)"
    elif own and search.chosen == 0:
        why = " (the search kept no layer 16-bit)"
    served = ", ".join(f"{k}={v}" for k, v in (b.served_with or {}).items())
    return f"same weights as {b.same_weights_as}{why}" + (f", served with {served}" if served else "")


def search_problem(search_file: Path | None, build: str) -> str | None:
    """Why `build` FAILs as the product of a search that found no passing candidate (the search stage's
    result at `search_file`), or None: no search file, another build's search, or a search that passed."""
    s = search_of(search_file)
    if s is None or s.build != build or s.skipped or s.passed:
        return None
    kept = ", ".join(str(x.kept) for x in s.screens)
    bound = f"; at most {s.max_bits_per_weight:g} bits per weight" if s.max_bits_per_weight is not None else ""
    if s.evaluations == 1:
        cheapest = "; the cheapest here, where the quantized kernel is the slower one" if s.kept_is_cheaper else ""
        which = f"the search's one screened candidate ({kept} layers kept 16-bit{bound}{cheapest}) was not shown"
    else:
        which = f"none of the search's {s.evaluations} screened candidates ({kept} layers kept 16-bit{bound}) was shown"
    return (
        f"{which} to pass every team, so it keeps {s.chosen} of {s.layers} layers 16-bit (results/search/trace.md); "
        + search_advice(s)
    )


def search_advice(s: SearchResult) -> str:
    """What could change a search that found no passing candidate, from what stopped it: a screen left
    undecided (more documents), the bound's own candidate failing (a higher bound), else the document budget
    ending before the bisection did (a search of one screen, where kept layers are cheaper, has no bisection);
    and always the base recipe."""
    advice = []
    if any(x.outcome == "undecided" for x in s.screens):
        advice.append("raise search.doc_budget or add a later look to search.looks (a screen ended undecided)")
    if s.max_kept is not None and any(x.kept == s.max_kept and x.outcome == "fail" for x in s.screens):
        advice.append(f"raise search.max_bits_per_weight (its most layers kept, {s.max_kept}, FAILed)")
    if not advice and not s.kept_is_cheaper:  # the bisection ran out of documents
        advice.append(f"raise search.doc_budget (its {s.doc_budget} documents ended the bisection)")
    return "; ".join([*advice, "or change the base recipe"])


def gate(
    eval_dir: Path,
    teams: list[Team],
    params: GateParams,
    search_file: Path | None = None,
    models_dir: Path | None = None,
) -> GateResult:
    """Verdicts for every candidate build, per team.

    `precision` is the baseline's precision record (None if it has none);
    a candidate evaluated at another dtype FAILs every team. A build whose search (`search_file`,
    the search stage's result) found no passing candidate FAILs, with that reason, whatever its teams say.
    With `models_dir`, a build with the weights of one before it (baseline first, then params order) has
    `same_weights_as`; its verdict is still its own.
    """
    builds, precision = {}, None
    digests = weights_digests(models_dir, [params.baseline, *params.candidates]) if models_dir else {}
    twins = same_weights(digests)
    for build in params.candidates:
        comparisons = {}
        for team in teams:
            try:
                base_scores = usable_scores(eval_dir, params.baseline, team.name)
                cand_scores = usable_scores(eval_dir, build, team.name)
                precision = same_precision(eval_dir, params.baseline, build)
                comparisons[team.name] = judge(team, base_scores, cand_scores, params, build)
            except QuantgateError as exc:
                comparisons[team.name] = TeamComparison(
                    verdict=Verdict.FAIL, metric=team.policy.metric, reason=project_relative(str(exc))
                )
        worst = max((Verdict(c.verdict) for c in comparisons.values()), key=SEVERITY.index)
        twin = {"same_weights_as": twins[build]} if build in twins else {}  # unset, not null: gate.json keeps its shape
        if twin and (served := served_apart(models_dir / build, models_dir / twins[build])):
            twin["served_with"] = served
        if models_dir and (wrong := inexact_kernel(eval_dir, models_dir, build, teams)):
            twin["inexact_kernel"] = wrong
        if why := search_problem(search_file, build):
            builds[build] = BuildGate(verdict=Verdict.FAIL, shippable=False, teams=comparisons, reason=why, **twin)
        else:
            builds[build] = BuildGate(verdict=worst, shippable=worst is Verdict.PASS, teams=comparisons, **twin)
    if precision is None:  # no candidate scored: the baseline's record still names what it was served at, and where
        try:
            precision = read_precision(eval_dir, params.baseline)
        except QuantgateError:
            pass
    return GateResult(baseline=params.baseline, precision=precision, builds=builds)


def build_line(build: str, b: BuildGate, search: SearchResult | None = None) -> str:
    """One build's verdict in a line (the gate stage's and `quantgate report`'s): why it FAILs whatever its teams
    say, the build whose weights it has (`search`, the search stage's result, says why) and its recommendation."""
    return (
        f"{build}: {b.verdict}"
        + (f" ({b.reason})" if b.reason else "")
        + (f"; {note}" if (note := same_weights_note(build, b, search)) else "")
        + (
            f"; served through an int8 kernel the platform probe found inexact here ({b.inexact_kernel}), by "
            "evaluate.serve.inexact_int8: its scores hold the kernel's error"
            if b.inexact_kernel
            else ""
        )
        + ("" if b.recommended is None else f"; {'' if b.recommended else 'not '}recommended: {b.recommendation}")
    )


def estimate_line(result: GateResult, search: SearchResult | None) -> str | None:
    """Whether the search's cost estimate held: its chosen candidate's estimated cost per output token (a multiple
    of the baseline's, priced here at the baseline's measured $ per 1M output tokens) beside what the build's
    profile measured (the gate's own figure), or None when the search priced nothing or kept no layer 16-bit
    (the build is then the base build, whose measured throughput the estimate is)."""
    if search is None or search.est_ratio is None or not search.chosen or search.build not in result.builds:
        return None
    base, cost = result.buys.get(result.baseline), result.buys.get(search.build)
    estimate = f"{search.est_ratio:.2f}x {result.baseline}'s cost per output token"
    if base is not None and base.usd_per_mtok is not None:
        usd = search.est_ratio * base.usd_per_mtok
        estimate = f"${usd:.3f} per 1M output tokens ({search.est_ratio:.2f}x {result.baseline})"
    measured = (
        f"its profile measured ${cost.usd_per_mtok:.3f} ({cost.usd_per_mtok_x:.2f}x)"
        if cost is not None and cost.usd_per_mtok is not None and cost.usd_per_mtok_x is not None
        else "it has no measured cost to check it against"
    )
    return f"{search.build}: the search estimated {estimate} for {search.chosen} layers kept 16-bit; {measured}"


def precision_line(result: GateResult) -> str:
    """One line naming the activation precision the baseline and every candidate compared with it were served at,
    and why: "every build" when each candidate was, else the baseline and those that were (a candidate refused, or
    scored at another dtype or on another machine kind, was not served at it: its reason is in the report)."""
    p = result.precision
    if not p:
        return "Served precision: unknown (no build was evaluated)."
    compared = [b for b, g in result.builds.items() if any(c.compared for c in g.teams.values())]
    if len(compared) == len(result.builds):
        who = "every build"
    elif compared:
        who = f"{result.baseline} and the candidates compared with it ({', '.join(compared)})"
    else:
        who = f"{result.baseline} (no candidate was compared with it)"
    where = (
        f" on a{'n' if (p.machine_kind or ' ')[0] in 'AEIOU' else ''} {p.machine_kind} machine"
        if p.machine_kind
        else ""
    )
    return f"Served precision: **{p.dtype}** for {who}{where} ({p.why}); kinds: {MACHINE_TABLE}."


def power_lines(result: GateResult, power: float = 0.9) -> list[str]:
    """Per team (0/1 metrics): does its set decide? At the largest share of documents any compared build
    disagreed with the baseline on, the probability that an equally good build PASSes on this many documents
    (quantgate.stats.pass_probability) and the documents that would give `power` (docs_for_power)."""
    worst: dict[str, TeamComparison] = {}
    for b in result.builds.values():
        for team, c in b.teams.items():
            if (
                c.compared
                and c.discordant
                and c.n
                and (team not in worst or sum(c.discordant) / c.n > sum(worst[team].discordant) / worst[team].n)
            ):
                worst[team] = c
    lines = []
    for team, c in sorted(worst.items()):
        psi = sum(c.discordant) / c.n
        if psi == 0:
            lines.append(f"- {team}: every build agreed with the baseline on all {c.n} documents")
            continue
        p = pass_probability(c.n, psi, c.margin, c.confidence)
        need = docs_for_power(psi, c.margin, c.confidence, power) if c.margin > 0 else None
        lines.append(
            f"- {team}: builds disagree with the baseline on up to {psi:.1%} of documents; at that rate an equally "
            f"good build PASSes with probability {p:.0%} on n={c.n} ({power:.0%} needs {need} documents)"
        )
    return lines


def report(
    result: GateResult,
    plot_name: str | None = None,
    cost_plot_name: str | None = None,
    search: SearchResult | None = None,
    costs: dict[str, Cost] | None = None,
) -> str:
    """The markdown gate report: summary per build (with the build whose weights it has, if any; `search`, the
    search stage's result, says why), the quality table, the plot link, what each build buys (when profiled)
    and its plot link, every reason, and what each team's set costs per build (`costs`, quantgate/budget.py).
    Image links are relative to the report's folder."""
    out = [
        "# quantgate gate report",
        "",
        precision_line(result),
        f"Baseline: `{result.baseline}`. Drop = baseline - candidate (candidate - baseline for a "
        "lower-is-better metric): positive = worse, the sign the margin bounds; the CI is the "
        "pair of one-sided bounds at each team's confidence. PASS needs the upper bound within the margin.",
        "",
    ]
    for build, b in result.builds.items():
        rec = "" if b.recommended is None else f"; {'recommended' if b.recommended else 'not recommended'}"
        out.append(f"- **{build}**: {b.verdict} ({'shippable' if b.shippable else 'not shippable'}{rec})")
        if b.reason:
            out.append(f"  - {b.reason}")
        if note := same_weights_note(build, b, search):
            out.append(f"  - {note}")
        if b.recommendation:
            out.append(f"  - recommendation: {b.recommendation}")
        if search is not None and build == search.build and (estimate := estimate_line(result, search)):
            out.append(f"  - {estimate}")
    out += ["", table(result), ""]
    if plot_name:
        out += [f"![recovery per team and build]({plot_name})", ""]
    if result.buys:
        out += ["## What it buys when served", "", buys.buys_table(result), "", BUYS_NOTE, ""]
        if cost_plot_name:
            out += [f"![quality vs cost per build]({cost_plot_name})", ""]
    out += ["## Reasons", ""]
    for build, b in result.builds.items():
        for team, c in b.teams.items():
            out.append(f"- {build} / {team}: {c.verdict}: {c.reason}")
    if power := power_lines(result):
        out += ["", "## Do the sets decide?", ""] + power
    if costs:
        out += ["", "## What each team's set costs per build", "", COST_NOTE, ""]
        out += [f"- {team}: {cost.line()}" for team, cost in sorted(costs.items())]
    return "\n".join(out) + "\n"


COST_NOTE = (
    "Estimated by validate before any build exists (quantgate/budget.py): documents scored, prompt tokens as "
    f"characters of the rendered requests / {CHARS_PER_TOKEN:g}, and the most tokens generation may produce; "
    "every build is scored on each set, within params.yaml `validate.budget`."
)


BUYS_NOTE = (
    "Measured by the profile stage on the serving engine at the run's precision (results/profile/<build>.json); "
    "priced with params.yaml `cost` (pipeline/buys.py): tok/s, TTFT and TPOT at the largest profiled concurrency "
    "C; req/device = vLLM's KV tokens // cost.context_tokens; devices for cost.qps by Little's law, the larger "
    "of the memory and batch-cap bounds; `x` = this build / the baseline. Recommended = PASS for every team "
    "and fewer $ per 1M output tokens than the baseline here."
)

USAGE = (
    "usage: python -m pipeline.gate EVAL_DIR EVALS_DIR METRICS_JSON REPORT_MD PLOT_PNG PROFILE_DIR COST_PNG COST_JSON "
    "MODELS_DIR"
)


def main() -> None:
    if len(sys.argv) != 10:
        raise QuantgateError(USAGE)
    eval_dir, evals_dir, metrics_path, report_path, plot_path, profile_dir, cost_png, cost_json, models_dir = map(
        Path, sys.argv[1:]
    )
    params = load_params()
    profiles = buys.read_profiles(profile_dir, [params.baseline, *params.candidates])
    cost = buys.load_cost(profiles[params.baseline])
    teams = load_teams(evals_dir)
    result = buys.apply(gate(eval_dir, teams, params, SEARCH_RESULT, models_dir), profiles, cost)
    search = search_of(SEARCH_RESULT)
    write_gate(metrics_path, result)
    report_path.write_text(report(result, plot_path.name, cost_png.name, search, {t.name: t.cost for t in teams}))
    recovery_plot(result, plot_path)
    points = buys.cost_points(result)
    cost_json.write_text(json.dumps(points, indent=1) + "\n")
    cost_plot(points, {b: c.reason or "?" for b, c in result.buys.items() if c.status != "profiled"}, cost_png)
    print(table(result))
    print(precision_line(result))
    print(buys.buys_table(result))
    for build, b in result.builds.items():
        print(f"gate: {build_line(build, b, search)}")
    if estimate := estimate_line(result, search):
        print(f"gate: {estimate}")


if __name__ == "__main__":
    run_main(main, log="gate")
