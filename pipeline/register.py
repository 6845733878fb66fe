"""Stage `register`: every build into the MLflow registry with its lineage and evidence.

Run by DVC: `python -m pipeline.register MODELS_DIR GATE_JSON REPORT_MD PLOT_PNG TEAMS_JSON EVAL_DIR OUT_JSON`
(params block `register`).

Every build (the 16-bit baseline and each candidate, whatever its verdict) becomes a version
of one registered model, tagged with its lineage and gate evidence; the baseline carries
alias `fallback`. Registering is not approving: a release manager approves a version
(registry/approval.py), and a version whose verdict is not PASS can only be approved with a
recorded override. Nothing is promoted here. Re-running with the same weights and evidence
reuses the existing version.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from quantgate.errors import QuantgateError, run_main
from quantgate.manifest import verify_weights
from quantgate.params import Frozen, load_block
from quantgate.precision import RECORD as PRECISION
from quantgate.results import SCORES, GateResult, TeamSummary, read_gate, read_scores, read_teams
from registry import aliases, audit, store, tags, versions


class RegisterParams(Frozen):
    model_name: str = "smollm2-135m-instruct"
    experiment: str = "quantgate-builds"


def serving_of(eval_dir: Path, build: str) -> dict:
    """Serving-stack versions recorded by the evaluate stage for `build` (empty if none)."""
    for path in sorted((eval_dir / build).glob(f"*/{SCORES}")):
        if (scores := read_scores(path)).serving:
            return scores.serving.versions
    return {}


def register(
    models_dir: Path,
    gate_result: GateResult,
    report_md: str,
    eval_dir: Path,
    params: RegisterParams,
    teams: dict[str, TeamSummary],
    evidence_files: list[Path] = (),
) -> dict:
    """Register every build as a version with lineage and evidence; alias the baseline `fallback`.

    `teams` is results/teams.json (per-team eval-set digests); `evidence_files` (the gate
    plot, the team summary) are logged as artifacts of every build's run beside the report.
    Returns {"model_name", "tracking_uri", "builds": {build: {"version", "run_id", "verdict", "reused"}}}.
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
    out = {"model_name": params.model_name, "tracking_uri": store.tracking_uri(), "builds": {}}
    for build in builds:
        build_gate = gate_result.builds.get(build)
        build_tags = {
            **tags.lineage_tags(manifests[build], serving_of(eval_dir, build)),
            **tags.gate_tags(build_gate, teams),
        }
        if (record := eval_dir / build / PRECISION).is_file():  # the activation dtype the gate judged it at
            build_tags[tags.EVAL_DTYPE] = json.loads(record.read_text())["dtype"]
        gate_evidence = {t: c.dump() for t, c in build_gate.teams.items()} if build_gate else {"baseline": build}
        build_tags[tags.EVIDENCE] = versions.evidence_digest(
            {"gate": gate_evidence, "teams": {t: s.dump() for t, s in teams.items()}}
        )
        verdict = build_tags[tags.VERDICT]
        existing = versions.find_version(client, params.model_name, build_tags[tags.WEIGHTS], build_tags[tags.EVIDENCE])
        if existing is not None:
            versions.record_verdict(client, existing.run_id, verdict)  # back-fills older runs
            out["builds"][build] = {
                "version": str(existing.version),
                "run_id": existing.run_id,
                "verdict": verdict,
                "reused": True,
            }
            print(f"register: {build}: reusing version {existing.version} (same weights and evidence)")
            continue
        metrics = {
            f"{team}.{k}": v
            for team, c in (build_gate.teams if build_gate else {}).items()
            for k in ("baseline", "candidate", "delta")
            if (v := getattr(c, k)) is not None
        }
        run_id, source = versions.log_build_run(
            client, exp_id, models_dir / build, build_tags, metrics, report_md, eval_dir / build, evidence_files
        )
        mv = versions.register_version(client, params.model_name, run_id, source, build_tags, report_md)
        out["builds"][build] = {"version": str(mv.version), "run_id": run_id, "verdict": verdict, "reused": False}
        print(
            f"register: {build}: version {mv.version} of {params.model_name}, gate {verdict}"
            + ("" if verdict in tags.PASSING else " (approval needs a recorded --override)")
        )
    fallback = out["builds"][baseline]["version"]
    changed = aliases.set_fallback(
        client, params.model_name, fallback, by=audit.default_user(), reason=f"register: baseline build {baseline}"
    )
    print(f"register: alias {aliases.FALLBACK} -> version {fallback}" + ("" if changed else " (unchanged)"))
    return out


USAGE = "python -m pipeline.register MODELS_DIR GATE_JSON REPORT_MD PLOT_PNG TEAMS_JSON EVAL_DIR OUT_JSON"


def main() -> None:
    if len(sys.argv) != 8:
        raise QuantgateError(f"usage: {USAGE}")
    models_dir, gate_json, report_md, plot_png, teams_json, eval_dir, out_json = map(Path, sys.argv[1:])
    for f in (gate_json, report_md, plot_png, teams_json):
        if not f.is_file():
            raise QuantgateError(f"{f} not found: run `dvc repro` (the gate and validate stages write it)")
    result = register(
        models_dir,
        read_gate(gate_json),
        report_md.read_text(),
        eval_dir,
        load_block("register", RegisterParams),
        read_teams(teams_json),
        [plot_png, teams_json],
    )
    out_json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    run_main(main, log="register")
