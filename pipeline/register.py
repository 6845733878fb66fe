"""Stage `register`: the builds that may ship into the MLflow registry, every build's evidence into MLflow.

Run by DVC: `python -m pipeline.register MODELS_DIR GATE_JSON REPORT_MD PLOT_PNG COST_PNG TEAMS_JSON EVAL_DIR OUT_JSON`
(params block `register`).

Every build is logged as a run (weights, gate report, per-team evidence, lineage and gate tags).
The 16-bit baseline and each build whose gate verdict is PASS also become a version of one
registered model, with the same tags; the baseline carries alias `fallback`. A build that did
not PASS stays a run only, listed by `quantgate status`; a release manager who ships it anyway
registers it with `quantgate register RUN_ID --override REASON` (registry/runs.py). Registering
is not approving (registry/approval.py). Nothing is promoted here. A build is a name plus its weights:
re-running with the same build, weights and evidence reuses its existing version or run (its what-it-buys
tags are brought up to date); two builds with one weights digest (a search that kept no layer 16-bit) keep
a run each, with their own verdicts, and the later is tagged `same_weights_as` the first (gate.json).

A version's description is written for the MLflow UI (`version_description`): this build first (its
verdict, recommendation, quality rows and what it buys beside the baseline), the plots as links to the
run's artifacts the UI serves (`get-artifact?path=...&run_uuid=...`, relative to the UI's own address),
then the whole gate report for the other builds.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from pipeline.buys import buys_table
from pipeline.report import table
from quantgate.errors import QuantgateError, project_relative, run_main
from quantgate.manifest import verify_weights
from quantgate.params import load_block
from quantgate.precision import RECORD as PRECISION
from quantgate.register_params import RegisterParams
from quantgate.results import (
    SCORES,
    BuildGate,
    GateResult,
    TeamSummary,
    check_consistent,
    read_gate,
    read_scores,
    read_teams,
)
from registry import aliases, audit, runs, store, tags, versions


def serving_of(eval_dir: Path, build: str) -> dict:
    """Serving-stack versions recorded by the evaluate stage for `build` (empty if none)."""
    for path in sorted((eval_dir / build).glob(f"*/{SCORES}")):
        if (scores := read_scores(path)).serving:
            return scores.serving.versions
    return {}


def tags_of(
    build: str,
    manifest: dict,
    build_gate: BuildGate | None,
    teams: dict[str, TeamSummary],
    eval_dir: Path,
    model_name: str,
) -> dict[str, str]:
    """The tags of a build's run (and of its version, if it gets one): lineage, gate evidence,
    the precision it was judged at, the evidence digest and the model it was built for."""
    build_tags = {
        **tags.lineage_tags(manifest, serving_of(eval_dir, build)),
        **tags.gate_tags(build_gate, teams),
        tags.MODEL: model_name,
    }
    if (record := eval_dir / build / PRECISION).is_file():  # the activation dtype the gate judged it at
        build_tags[tags.EVAL_DTYPE] = json.loads(record.read_text())["dtype"]
    gate_evidence = {t: c.dump() for t, c in build_gate.teams.items()} if build_gate else {"baseline": build}
    build_tags[tags.EVIDENCE] = versions.evidence_digest(
        {"gate": gate_evidence, "teams": {t: s.dump() for t, s in teams.items()}}
    )
    return build_tags


def artifact_link(run_id: str, path: str) -> str:
    """The URL of run artifact `path` as the MLflow UI serves it (mlflow/server: route `/get-artifact`, args
    `path` and `run_uuid`), relative, so it resolves against whatever address (and static prefix) the UI has."""
    return f"get-artifact?path={path}&run_uuid={run_id}"


def version_description(result: GateResult, build: str, run_id: str, report_md: str) -> str:
    """The model version's description for the MLflow UI: `build` first (verdict, recommendation, its quality
    rows, what it buys beside the baseline, the plots as links to run `run_id`'s artifacts), then the whole gate
    report (`report_md`, without its relative image links, which do not resolve in the UI) for the other builds.
    Paths are the project's, never the machine's."""
    g = result.builds.get(build)
    head = f"# {build}: " + (
        "16-bit baseline (gate BASELINE)"
        if g is None
        else f"gate {g.verdict}" + ("" if g.recommended is None else f", {'' if g.recommended else 'not '}recommended")
    )
    out = [head, ""]
    if g is not None and g.recommendation:
        out += [f"Recommendation: {g.recommendation}.", ""]
    if g is not None:
        out += [table(result, [build]), ""]
    if result.buys:
        shown = [build] + ([result.baseline] if build != result.baseline else [])
        out += ["## What it buys when served", "", buys_table(result, shown), ""]
    out += [
        f"![quality vs cost per build]({artifact_link(run_id, 'gate_cost.png')})",
        "",
        f"![recovery per team and build]({artifact_link(run_id, 'gate_recovery.png')})",
        "",
        f"Full report: [gate_report.md]({artifact_link(run_id, 'gate_report.md')}) (run artifact).",
        "",
        "---",
        "",
        "# All builds",
        "",
    ]
    body = re.sub(r"^!\[[^\]]*\]\([\w.-]+\.png\)\n\n?", "", report_md, flags=re.M)  # the plots are linked above
    return project_relative("\n".join(out) + body.removeprefix("# quantgate gate report\n"))


def register(
    models_dir: Path,
    gate_result: GateResult,
    report_md: str,
    eval_dir: Path,
    params: RegisterParams,
    teams: dict[str, TeamSummary],
    evidence_files: list[Path] = (),
) -> dict:
    """Log every build as a run; register the baseline and PASS builds as versions; alias the baseline `fallback`.

    `teams` is results/teams.json (per-team eval-set digests); `evidence_files` (the gate
    plot, the team summary) are logged as artifacts of every build's run beside the report.
    Returns {"model_name", "tracking_uri", "builds": {build: {"version", "run_id", "verdict", "reused"}},
    "unregistered": {build: {"run_id", "verdict", "reused"}}}: the versions and the runs left unregistered.
    Raises QuantgateError if a build's weights no longer match its manifest (checked for
    every build before anything is written).
    """
    baseline = gate_result.baseline
    builds = [baseline, *gate_result.builds]
    manifests = {b: verify_weights(models_dir / b) for b in builds}  # check all before writing anything
    client = store.client()
    exp_id = store.experiment_id(client, params.experiment)
    versions.ensure_registered_model(
        client, params.model_name, f"Builds of {manifests[baseline]['base_model']['id']} made by quantgate"
    )
    out = {"model_name": params.model_name, "tracking_uri": store.tracking_uri(), "builds": {}, "unregistered": {}}
    for build in builds:
        build_gate = gate_result.builds.get(build)
        build_tags = tags_of(build, manifests[build], build_gate, teams, eval_dir, params.model_name)
        buys = tags.buys_tags(gate_result.buys.get(build), build_gate)  # not evidence: updated on reuse
        twin = build_gate.same_weights_as if build_gate else None  # nor is the build with the same weights
        # a release manager approving in the UI sees what its scores were measured through (gate.json inexact_kernel)
        inexact = build_gate.inexact_kernel if build_gate else None
        notes = (
            buys
            | ({tags.SAME_WEIGHTS: twin} if twin else {})
            | ({tags.INEXACT_KERNEL: inexact[:500]} if inexact else {})
        )
        build_tags |= notes
        verdict = build_tags[tags.VERDICT]
        key = (build_tags[tags.BUILD], build_tags[tags.WEIGHTS], build_tags[tags.EVIDENCE])
        existing = versions.find_version(client, params.model_name, *key)
        ships = existing is not None or verdict in tags.PASSING  # a version already, or one to make
        run_id = existing.run_id if existing else None
        if not ships:
            run_id = runs.find_run(client, exp_id, params.model_name, *key)
        reused = run_id is not None
        if reused:
            versions.record_verdict(client, run_id, verdict)  # back-fills older runs
            versions.update_tags(
                client,
                run_id,
                notes,
                params.model_name,
                existing.version if existing else None,
                drop=(() if twin else (tags.SAME_WEIGHTS,)) + (() if inexact else (tags.INEXACT_KERNEL,)),  # gone since
            )
            versions.log_report(client, run_id, report_md, evidence_files)  # the plots the description links
        else:
            metrics = {
                f"{team}.{k}": v
                for team, c in (build_gate.teams if build_gate else {}).items()
                for k in ("baseline", "candidate", "delta")
                if (v := getattr(c, k)) is not None
            }
            run_id, source = versions.log_build_run(
                client, exp_id, models_dir / build, build_tags, metrics, report_md, eval_dir / build, evidence_files
            )
        entry = {"run_id": run_id, "verdict": verdict, "reused": reused}
        same = f"; same weights as {twin}" if twin else ""
        if not ships:
            out["unregistered"][build] = entry
            print(
                f"register: {build}: gate {verdict}, {'reusing ' if reused else ''}run {run_id}, not registered "
                f"(to ship it anyway: quantgate register {run_id} --override REASON){same}"
            )
            continue
        description = version_description(gate_result, build, run_id, report_md)
        if existing is not None:
            client.update_model_version(params.model_name, existing.version, description=description[:4900])
        mv = existing or versions.register_version(client, params.model_name, run_id, source, build_tags, description)
        out["builds"][build] = {"version": str(mv.version), **entry}
        print(
            f"register: {build}: "
            + (
                f"reusing version {mv.version} (same build, weights and evidence)"
                if reused
                else f"version {mv.version}"
            )
            + f" of {params.model_name}, gate {verdict}"
            + ("" if verdict in tags.PASSING else " (approval needs a recorded --override)")
            + same
        )
    runs.record_unregistered(client, params.model_name, [b["run_id"] for b in out["unregistered"].values()])
    fallback = out["builds"][baseline]["version"]
    changed = aliases.set_fallback(
        client, params.model_name, fallback, by=audit.default_user(), reason=f"register: baseline build {baseline}"
    )
    print(f"register: alias {aliases.FALLBACK} -> version {fallback}" + ("" if changed else " (unchanged)"))
    return out


USAGE = "python -m pipeline.register MODELS_DIR GATE_JSON REPORT_MD PLOT_PNG COST_PNG TEAMS_JSON EVAL_DIR OUT_JSON"


def main() -> None:
    if len(sys.argv) != 9:
        raise QuantgateError(f"usage: {USAGE}")
    models_dir, gate_json, report_md, plot_png, cost_png, teams_json, eval_dir, out_json = map(Path, sys.argv[1:])
    for f in (gate_json, report_md, plot_png, cost_png, teams_json):
        if not f.is_file():
            raise QuantgateError(f"{f} not found: run `dvc repro` (the gate and validate stages write it)")
    gate = read_gate(gate_json)
    check_consistent(gate, gate_json)  # a verdict its own evidence does not give is never registered
    result = register(
        models_dir,
        gate,
        report_md.read_text(),
        eval_dir,
        load_block("register", RegisterParams),
        read_teams(teams_json),
        [plot_png, cost_png, teams_json],
    )
    out_json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    run_main(main, log="register")
