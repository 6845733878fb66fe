"""Build runs that are not model versions, and registering one by override.

The register stage makes a model version of the 16-bit baseline and of each build that PASSes
its gate. Any other build is logged as a run only (weights, gate report, per-team evidence, the
same tags a version gets, plus `quantgate.model`), so the registry lists only what may ship.
A release manager who ships such a build anyway registers it from its run:

    quantgate register RUN_ID --override REASON

which verifies the run's weights against its tags, creates the version (its gate.verdict is
the run's recorded one), records who and why on it and in the audit trail. Approving that
version still needs `quantgate approve ... --override REASON` (registry/approval.py).
"""

from __future__ import annotations

import json
import tempfile
import uuid
from pathlib import Path

from quantgate.errors import QuantgateError
from registry import audit, lock, tags, verify, versions
from registry.approval import check_length, require_text


def find_run(
    mlflow_client, exp_id: str, model_name: str, build: str, weights_digest: str, evidence_digest: str
) -> str | None:
    """The id of a finished run of build `build` of `model_name` with the same weights and evidence, or None.

    A build is a name plus its weights: two builds with one weights digest (a search that kept no layer
    16-bit) each keep a run of their own, with their own verdict. Runs logged before the build was part of
    this lookup carry the build tag too, so they are reused as before."""
    found = mlflow_client.search_runs(
        [exp_id],
        filter_string=(
            f"tags.`{tags.MODEL}` = '{model_name}' and tags.{tags.BUILD} = '{build}' "
            f"and tags.{tags.WEIGHTS} = '{weights_digest}' "
            f"and tags.{tags.EVIDENCE} = '{evidence_digest}' and attributes.status = 'FINISHED'"
        ),
        max_results=1,
    )
    return found[0].info.run_id if found else None


def record_unregistered(mlflow_client, model_name: str, run_ids: list[str]) -> None:
    """Remember on the registered model which build runs the last register stage left unregistered."""
    value = json.dumps(sorted(run_ids))
    if mlflow_client.get_registered_model(model_name).tags.get(tags.UNREGISTERED) != value:
        mlflow_client.set_registered_model_tag(model_name, tags.UNREGISTERED, value)


def unregistered(mlflow_client, model_name: str) -> list:
    """The runs of the last register stage's unregistered builds that are still not versions, by build."""
    from mlflow.exceptions import MlflowException

    listed = json.loads(mlflow_client.get_registered_model(model_name).tags.get(tags.UNREGISTERED) or "[]")
    found = []
    for run_id in listed:
        if registered_as(mlflow_client, run_id):
            continue  # registered by override since: it is listed with the versions
        try:
            run = mlflow_client.get_run(run_id)
        except MlflowException:
            continue  # deleted for good: nothing left to register
        if run.info.lifecycle_stage == "active":
            found.append(run)
    return sorted(found, key=lambda r: r.data.tags.get(tags.BUILD, ""))


def registered_as(mlflow_client, run_id: str):
    """The model version created from run `run_id`, or None."""
    found = mlflow_client.search_model_versions(f"run_id='{run_id}'")
    return found[0] if found else None


def build_run(mlflow_client, run_id: str):
    """Run `run_id`, which must be an active, finished quantgate build run of some model that is
    not a version yet; raise QuantgateError saying which of these it is not. An MlflowException other than the
    run's absence (the registry failed to answer) is raised as it is, for the command to say."""
    from mlflow.exceptions import MlflowException

    try:
        run = mlflow_client.get_run(run_id)
    except MlflowException as exc:  # the run missing, or no run id at all ('../x'); else the registry failed
        if getattr(exc, "error_code", "") not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise
        raise QuantgateError(
            f"run {run_id!r} does not exist in this registry; `quantgate status` lists the unregistered "
            f"builds with their run ids"
        ) from None
    t = run.data.tags
    if tags.BUILD not in t or tags.WEIGHTS not in t or tags.VERDICT not in run.data.params:
        raise QuantgateError(
            f"run {run_id} is not a quantgate build run (no build, weights_sha256 or gate.verdict); "
            f"`quantgate status` lists the unregistered builds with their run ids"
        )
    if (mv := registered_as(mlflow_client, run_id)) is not None:
        raise QuantgateError(f"run {run_id} (build {t[tags.BUILD]}) is already registered as {mv.name} v{mv.version}")
    if run.info.lifecycle_stage != "active" or run.info.status != "FINISHED" or tags.MODEL not in t:
        raise QuantgateError(
            f"run {run_id} (build {t[tags.BUILD]}) is {run.info.lifecycle_stage} and {run.info.status}"
            + ("" if tags.MODEL in t else f", without tag {tags.MODEL}")
            + "; only a complete build run can be registered: run `dvc repro` again"
        )
    return run


def register_run(mlflow_client, run_id: str, by: str, override_reason: str | None):
    """Make build run `run_id` a version of the model it was built for; return the version.

    A build whose recorded gate verdict is not PASS needs `override_reason` (recorded on the
    version and in the audit trail); for a passing one it is not needed and not recorded. The
    run's weights are verified against its tags before anything is written. Raises
    QuantgateError for an unknown run, a run that is not a quantgate build run, one already
    registered, a missing override, or weights that do not match.
    """
    require_text(by=by)
    check_length(override=override_reason)
    run = build_run(mlflow_client, run_id)
    model, build = run.data.tags[tags.MODEL], run.data.tags[tags.BUILD]
    verdict = run.data.params[tags.VERDICT]  # the verdict of record (run tags can be edited)
    if verdict in tags.PASSING:
        override_reason = None
    elif not (override_reason or "").strip():
        raise QuantgateError(
            f"run {run_id} (build {build} of {model}): gate.verdict is {verdict}, not PASS, so it was not "
            f"registered; to ship it anyway: quantgate register {run_id} --override REASON (recorded and audited)"
        )
    with lock.held(mlflow_client, model, f"register by {by}", by=by) as lk:
        run = build_run(mlflow_client, run_id)  # again, under the lock: not registered meanwhile
        with tempfile.TemporaryDirectory() as tmp:
            verify.verify_run(mlflow_client, run, Path(tmp))
        at = audit.utc_now()
        version_tags = {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")}
        version_tags |= {tags.VERDICT: verdict, tags.REGISTERED_BY: by, tags.REGISTERED_AT: at.isoformat()}
        if override_reason:
            version_tags[tags.REGISTERED_OVERRIDE] = override_reason
        with audit.audited(
            mlflow_client,
            model,
            action="register",
            by=by,
            reason=f"register build {build} from run {run_id} (gate.verdict={verdict})",
            at=at,
            op=uuid.uuid4().hex,
            build_run_id=run_id,
            override_reason=override_reason,
        ) as [audit_run]:
            lk.check()
            mv = versions.register_version(
                mlflow_client,
                model,
                run_id,
                f"{run.info.artifact_uri}/model",
                version_tags,
                f"build {build}, gate {verdict}, registered by {by}"
                + (f" overriding the gate: {override_reason}" if override_reason else ""),
            )
            mlflow_client.log_param(audit_run, "version", mv.version)
    return mv
