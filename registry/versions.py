"""Register a build as an MLflow model version with its lineage and gate evidence.

Tags written on every version: the schema and its builders are in registry/tags.py.
The build's run also holds gate.verdict as a param: MLflow refuses to change a logged param,
so that is the verdict of record (`recorded_verdict`); the version tag is the UI's copy and
an edit of it does not count (registry/approval.py).
The version is created in one call with all its tags after every artifact is logged, so a
failure part-way leaves a FAILED run and no version: never a half-written version.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from pathlib import Path

from quantgate.errors import QuantgateError
from quantgate.hashing import digest_json
from registry.tags import BUILD, EVIDENCE, VERDICT, WEIGHTS

# the alias of the 16-bit build; all aliases and how they move: registry/aliases.py
FALLBACK = "fallback"


def version_number(version) -> str:
    """ "3", 3 or "v3" -> "3"; raise QuantgateError for anything else."""
    text = str(version).strip().lower().removeprefix("v")
    if not (text.isascii() and text.isdigit()):  # str.isdigit() also accepts "²" and "١"
        raise QuantgateError(f"{version!r} is not a model version number (e.g. 3 or v3)")
    return text.lstrip("0") or "0"  # not int(): it raises on 4300+ digits


# MLflow's SQL stores keep a version number in an Integer column, 32 bits in PostgreSQL and MySQL (sqlite: 64): no
# version above this exists anywhere, and asking a store for one failed with its internal error (sqlite's "Python int
# too large to convert to SQLite INTEGER") instead of saying the version does not exist
MAX_VERSION = 2**31 - 1


def get_version(mlflow_client, model_name: str, version):
    """Version `version` of `model_name` (any status), or None when it does not exist: never registered, deleted,
    or a number above MAX_VERSION (not asked: no store could hold it). Other registry errors propagate."""
    from mlflow.exceptions import MlflowException

    number = version_number(version)
    if len(number) > len(str(MAX_VERSION)) or int(number) > MAX_VERSION:
        return None
    try:
        return mlflow_client.get_model_version(model_name, number)
    except MlflowException as exc:
        if getattr(exc, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
            raise
        return None


def not_registered(mlflow_client, model_name: str) -> QuantgateError:
    """The error for a model that is not registered at the client's tracking URI (named, with what to check)."""
    where = getattr(mlflow_client, "tracking_uri", None) or "this tracking URI"
    return QuantgateError(
        f"model {model_name!r} is not registered at {where}; check the name (params.yaml "
        "register.model_name) or MLFLOW_TRACKING_URI"
    )


def registered_model(mlflow_client, model_name: str):
    """The registered model `model_name` (MLflow's RegisteredModel, with its aliases and tags). Raises
    QuantgateError (not_registered) when there is none; any other registry answer propagates as MLflow gave it."""
    from mlflow.exceptions import MlflowException

    try:
        return mlflow_client.get_registered_model(model_name)
    except MlflowException as exc:
        if getattr(exc, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
            raise
        raise not_registered(mlflow_client, model_name) from None


def require_version(mlflow_client, model_name: str, version):
    """The model version, which must exist and be READY.

    Raises QuantgateError when it was never registered, was deleted, or is not READY, so
    nothing (an alias, an approval) is ever made to point at it; when the model itself is not
    registered, says that (not_registered), as `quantgate status MODEL` does.
    """
    number = version_number(version)
    mv = get_version(mlflow_client, model_name, number)
    if mv is None:
        registered_model(mlflow_client, model_name)  # a misspelled model or another registry: said as such
        raise QuantgateError(
            f"{model_name} v{number} does not exist (never registered, or deleted); see `quantgate status {model_name}`"
        )
    if mv.status != "READY":
        raise QuantgateError(f"{model_name} v{number} is {mv.status}, not READY; it cannot be approved or aliased")
    return mv


def find_version(mlflow_client, model_name: str, build: str, weights_digest: str, evidence_digest: str):
    """The existing version of `model_name` for build `build` with the same weights and evidence, or None
    (one version at most per build name, weights and evidence: registry/runs.py `find_run`)."""
    key = (build, weights_digest, evidence_digest)
    for mv in mlflow_client.search_model_versions(f"name='{model_name}'"):
        if (mv.tags.get(BUILD), mv.tags.get(WEIGHTS), mv.tags.get(EVIDENCE)) == key:
            return mv
    return None


def ensure_registered_model(mlflow_client, model_name: str, description: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        mlflow_client.get_registered_model(model_name)
    except MlflowException:
        mlflow_client.create_registered_model(model_name, description=description)


def log_build_run(
    mlflow_client,
    exp_id: str,
    model_dir: Path,
    tags: dict,
    metrics: dict,
    report_md: str,
    evidence_dir: Path | None,
    extra_files: Iterable[Path] = (),
) -> tuple[str, str]:
    """Create a run holding the build's weights (artifact path `model`), the gate report,
    `extra_files` (e.g. the recovery plot) at the root, and the per-team scores under
    `evidence/`; return (run_id, model artifact URI). The run ends FAILED on error."""
    run = mlflow_client.create_run(exp_id, tags=tags, run_name=f"build-{tags['build']}")
    run_id = run.info.run_id
    try:
        record_verdict(mlflow_client, run_id, tags[VERDICT])
        for key, value in metrics.items():
            mlflow_client.log_metric(run_id, key, value)
        mlflow_client.log_artifacts(run_id, str(model_dir), artifact_path="model")
        log_report(mlflow_client, run_id, report_md, extra_files)
        if evidence_dir is not None and evidence_dir.is_dir():
            mlflow_client.log_artifacts(run_id, str(evidence_dir), artifact_path="evidence")
    except BaseException:
        mlflow_client.set_terminated(run_id, status="FAILED")
        raise
    mlflow_client.set_terminated(run_id, status="FINISHED")
    return run_id, f"{mlflow_client.get_run(run_id).info.artifact_uri}/model"


GONE = "gone:"  # recorded_verdict of a version whose run no longer exists: GONE + run id


def log_report(mlflow_client, run_id: str, report_md: str, extra_files: Iterable[Path] = ()) -> None:
    """Log the gate report (as gate_report.md) and `extra_files` (the plots, the team summary) at the root of
    run `run_id`'s artifacts, replacing older copies (a reused run gets the current report and plots)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "gate_report.md").write_text(report_md)
        mlflow_client.log_artifact(run_id, str(Path(tmp) / "gate_report.md"))
    for f in extra_files:
        if Path(f).is_file():
            mlflow_client.log_artifact(run_id, str(f))


def recorded_verdict(mlflow_client, mv) -> str | None:
    """The gate verdict logged as a param of version `mv`'s run at registration; None when
    the run has none (registered before quantgate recorded it); GONE + run id when the run no
    longer exists (purged by `mlflow gc`): the record cannot be read, and a version without
    its record is read as NOT approved (registry/approval.py). Other registry errors propagate."""
    from mlflow.exceptions import MlflowException

    if not mv.run_id:
        return None
    try:
        return mlflow_client.get_run(mv.run_id).data.params.get(VERDICT)
    except MlflowException as exc:
        if getattr(exc, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
            raise
        return GONE + mv.run_id


def record_verdict(mlflow_client, run_id: str, verdict: str) -> None:
    """Log `verdict` as the run's gate.verdict param, unless it is there already (this
    back-fills runs registered before it was recorded). Raises QuantgateError if the run
    recorded another verdict (params cannot change: the evidence no longer matches the run)."""
    have = mlflow_client.get_run(run_id).data.params.get(VERDICT)
    if have is None:
        mlflow_client.log_param(run_id, VERDICT, verdict)
    elif have != verdict:
        raise QuantgateError(
            f"run {run_id} recorded gate.verdict={have} but the gate now says {verdict} for the "
            f"same build, weights and evidence; register cannot reuse it"
        )


def update_tags(
    mlflow_client, run_id: str, values: dict[str, str], model_name: str, version=None, drop: Iterable[str] = ()
) -> None:
    """Set `values` as tags of run `run_id` and, when given, of `model_name` version `version`, and delete the
    tags `drop` where they are set (figures and notes that are not evidence, such as what a build buys or which
    build has the same weights, brought up to date on a reused run or version)."""
    for key, value in values.items():
        mlflow_client.set_tag(run_id, key, value)
        if version is not None:
            mlflow_client.set_model_version_tag(model_name, str(version), key, value)
    if not drop:
        return
    run_tags = mlflow_client.get_run(run_id).data.tags
    version_tags = mlflow_client.get_model_version(model_name, str(version)).tags if version is not None else {}
    for key in drop:
        if key in run_tags:  # MLflow refuses to delete a tag that is not there
            mlflow_client.delete_tag(run_id, key)
        if key in version_tags:
            mlflow_client.delete_model_version_tag(model_name, str(version), key)


def register_version(mlflow_client, model_name: str, run_id: str, source: str, tags: dict, description: str):
    """Create the model version (all tags at once) and return it."""
    return mlflow_client.create_model_version(
        model_name, source=source, run_id=run_id, tags=tags, description=description[:4900]
    )


def evidence_digest(gate_rows: dict) -> str:
    """Digest of the gate evidence for a build (team rows without run-specific noise)."""
    return digest_json(gate_rows)
