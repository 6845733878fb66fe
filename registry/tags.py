"""The registry's tag schema: every tag key and verdict literal that registry/, canary/ and the
register stage write or read, and the builders of a version's lineage and gate tags.

Tags on every model version (searchable in the UI and with `search_model_versions`):
  build, scheme, dtype, weights_sha256 (one digest over all weight files),
  weights_sha256.<file>, base_model.id, base_model.sha256, recipe, kv_cache_dtype and w4a8 (where the build
  sets them: how every server of it runs it), git_commit, dvc_lock_sha256,
  params_sha256, version.<library> for the pipeline stack, version.serving.<library>,
  gate.verdict, gate.<team>.{verdict,metric,delta,ci,recovery_pct,reason,team_sha256},
  gate.inexact_kernel (an int8 build served through a kernel the platform probe found inexact, by
  evaluate.serve.inexact_int8: the probe's answer; its scores hold the kernel's error),
  eval.dtype, evidence_sha256, recommended ("yes" | "no" | "baseline") and recommendation (why),
  buys.{status,reason,usd_per_mtok,usd_per_mtok_x,output_tokens_per_s,kv_tokens,kv_tokens_x,
  requests_per_device,devices,devices_x,weights_mib,kv_cache_dtype,concurrency,ttft_ms_p50,tpot_ms_p50}
  (what the build buys when served, pipeline/buys.py; updated on a version that is reused; the latencies
  are the profile's p50s in ms at `concurrency` requests in flight, canary/forecast.py reads them);
  approval tags: registry/approval.py.
Every build's run (in the register experiment) has the same tags plus quantgate.model; a version
registered by override (registry/runs.py) also has registration.{by,at,override_reason}. A build whose
weights are another build's of the same pipeline run (gate.json `same_weights_as`: a search that kept no layer
16-bit) has same_weights_as = that build on its run and version. The
registered model has tag quantgate.unregistered_runs: the build runs the last register stage left
unregistered (a JSON list of run ids).
"""

from __future__ import annotations

import json
import subprocess
from importlib import metadata
from pathlib import Path

from quantgate.hashing import sha256_file
from quantgate.manifest import serving_tags
from quantgate.params import PARAMS_FILE
from quantgate.results import BuildCost, BuildGate, TeamSummary
from quantgate.stats import BASELINE, Verdict

VERDICT = "gate.verdict"  # version tag and run param (the run param is the verdict of record)
PASSING = (Verdict.PASS.value, BASELINE)  # gate verdicts that need no override to be approved (quantgate.stats)
BUILD, SCHEME, WEIGHTS = "build", "scheme", "weights_sha256"
EVAL_DTYPE, EVIDENCE = "eval.dtype", "evidence_sha256"
INEXACT_KERNEL = "gate.inexact_kernel"  # gate.json inexact_kernel: the probe's wrong answer it was served through
MODEL = "quantgate.model"  # on a build run: the registered model it was built for
SAME_WEIGHTS = "same_weights_as"  # on a build run and version: the build of the same run with these weights
UNREGISTERED = "quantgate.unregistered_runs"  # registered-model tag, see the module docstring
REGISTERED_BY, REGISTERED_AT, REGISTERED_OVERRIDE = "registration.by", "registration.at", "registration.override_reason"

RECOMMENDED, RECOMMENDATION = "recommended", "recommendation"  # the gate's cost policy, apart from its verdict
BUYS_FIELDS = (
    "status",
    "reason",
    "usd_per_mtok",
    "usd_per_mtok_x",
    "output_tokens_per_s",
    "kv_tokens",
    "kv_tokens_x",
    "requests_per_device",
    "devices",
    "devices_x",
    "weights_mib",
    "kv_cache_dtype",
    "concurrency",
    "ttft_ms_p50",
    "tpot_ms_p50",
)

PIPELINE_LIBS = ["llmcompressor", "compressed-tensors", "lm_eval", "transformers", "torch", "mlflow", "dvc"]


def team_tag(team: str, field: str) -> str:
    """gate.<team>.<field>, e.g. gate.search.verdict."""
    return f"gate.{team}.{field}"


def team_verdicts(tags: dict[str, str]) -> dict[str, str]:
    """{team: verdict} from a version's gate.<team>.verdict tags, sorted by team."""
    teams = sorted(
        {k.split(".")[1] for k in tags if k.startswith("gate.") and k.endswith(".verdict") and k.count(".") == 2}
    )
    return {team: tags[team_tag(team, "verdict")] for team in teams}


def git_commit() -> str:
    """HEAD commit, with "-dirty" when the work tree has uncommitted changes; "unknown" outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, check=True
        ).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def lineage_tags(manifest: dict, serving: dict) -> dict[str, str]:
    """Build identity and provenance as flat string tags."""
    tags = {
        BUILD: manifest["build"],
        SCHEME: manifest["scheme"],
        "dtype": manifest["dtype"],
        WEIGHTS: manifest["weights_digest"],
        "base_model.id": manifest["base_model"]["id"],
        "base_model.sha256": manifest["base_model"]["sha256"],
        "recipe": json.dumps(manifest["recipe"], sort_keys=True),
        "git_commit": git_commit(),
        "params_sha256": sha256_file(PARAMS_FILE),
    }
    tags.update({f"{WEIGHTS}.{name}": digest for name, digest in manifest["weights"].items()})
    # how every server of the build runs it (build.json, quantize.<build>): its KV cache dtype, W4A8
    tags.update(serving_tags(manifest))
    if Path("dvc.lock").is_file():
        tags["dvc_lock_sha256"] = sha256_file(Path("dvc.lock"))
    for lib in PIPELINE_LIBS:
        try:
            tags[f"version.{lib}"] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            pass
    tags.update({f"version.serving.{k}": str(v) for k, v in serving.items() if v})
    return tags


def gate_tags(build_gate: BuildGate | None, teams: dict[str, TeamSummary]) -> dict[str, str]:
    """Per-team evidence as tags; the baseline has no gate comparisons and is tagged BASELINE.

    `teams` is the validate stage's summary (results/teams.json): each team's eval-set
    digest is recorded on every version, so a verdict names the exact set it was made on.
    """
    tags = {team_tag(team, "team_sha256"): t.sha256 for team, t in teams.items()}
    if build_gate is None:
        return {**tags, VERDICT: BASELINE}
    tags[VERDICT] = build_gate.verdict
    for team, c in build_gate.teams.items():
        tags[team_tag(team, "verdict")] = c.verdict
        tags[team_tag(team, "metric")] = c.metric
        if c.delta is not None:
            tags[team_tag(team, "delta")] = f"{c.delta:+.4f}"
            tags[team_tag(team, "ci")] = f"[{c.lower:+.4f}, {c.upper:+.4f}]"
            tags[team_tag(team, "recovery_pct")] = f"{c.recovery_pct:.2f}" if c.recovery_pct is not None else "-"
        else:
            tags[team_tag(team, "reason")] = c.reason[:500]
    return tags


def buys_tags(cost: BuildCost | None, build_gate: BuildGate | None) -> dict[str, str]:
    """What the build buys (buys.<field>, BuildCost of gate.json's `buys`) and the recommendation as tags;
    `build_gate` None = the baseline (recommended "baseline"). Empty when the gate priced nothing."""
    out = {}
    if cost is not None:
        for field in BUYS_FIELDS:
            if (value := getattr(cost, field)) is not None:
                out[f"buys.{field}"] = str(value)[:500]
    if build_gate is None:
        return {**out, RECOMMENDED: "baseline"} if cost is not None else out
    if build_gate.recommended is not None:
        out[RECOMMENDED] = "yes" if build_gate.recommended else "no"
        out[RECOMMENDATION] = (build_gate.recommendation or "")[:500]
    return out
