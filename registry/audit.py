"""The audit trail: one MLflow run per alias change and per approval/revocation.

Runs live in experiment `quantgate-audit`. Each run's params (immutable once logged) are:
  action (promote, rollback, set_candidate, clear_candidate, set_fallback, approve, revoke,
  register, break_lock: a stale lock broken, its holder named in reason), model, by, at (UTC
  ISO, milliseconds), reason, step (order within one action), op
  (one id per action), and where they apply: alias, from_version, to_version ("none" = unset),
  version (approve/revoke/register), override_reason, canary_run_id, approved_by (promote),
  build_run_id (register: the build run a version was made from by override).
Tags: mlflow.user = by, mlflow.runName = a one-line summary, quantgate.action, quantgate.model.

A run is created RUNNING before the registry is changed and ends FINISHED after the change
(its end time = Event.done_at, when the change took effect; `at` is when it was asked for),
or FAILED if the change did not happen. Only FINISHED runs count in `history`; a run still
RUNNING marks a change whose process died mid-way (check the aliases in the UI).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

AUDIT_EXPERIMENT = "quantgate-audit"
UNSET = "none"
MAX_TEXT = 5000  # characters kept of free text (MLflow param values are limited to 6000)


def default_user() -> str:
    """Who is acting when `--by` is not given: $USER, else $LOGNAME, else "unknown"."""
    return os.environ.get("USER") or os.environ.get("LOGNAME") or "unknown"


def utc_now() -> datetime:
    """Now, UTC, truncated to milliseconds (the precision MLflow keeps for run times)."""
    now = datetime.now(timezone.utc)
    return now.replace(microsecond=now.microsecond // 1000 * 1000)


def as_utc(when: datetime) -> datetime:
    """`when` as an aware UTC datetime; a naive datetime is taken to be UTC."""
    return when.replace(tzinfo=timezone.utc) if when.tzinfo is None else when.astimezone(timezone.utc)


@dataclass(frozen=True)
class Event:
    """One audited change, as read back from its run."""

    at: datetime
    action: str
    model: str
    by: str
    reason: str
    alias: str | None = None
    from_version: str | None = None
    to_version: str | None = None
    version: str | None = None
    override_reason: str | None = None
    canary_run_id: str | None = None
    step: int = 0
    run_id: str = ""
    done_at: datetime | None = None  # when the run ended FINISHED, right after the registry write

    @property
    def took_s(self) -> float | None:
        """Seconds from the request (`at`) to the change being written (`done_at`)."""
        return (self.done_at - self.at).total_seconds() if self.done_at else None

    def line(self) -> str:
        """One human line: `2025-01-01T10:00:00.000+00:00 promote production v1 -> v2 by alice: reason`."""
        if self.alias:
            what = f"{self.alias} {version_label(self.from_version)} -> {version_label(self.to_version)}"
        else:
            what = f"v{self.version}" if self.version else "lock"  # break_lock names no version
        extra = "".join(
            [
                f" [override: {self.override_reason}]" if self.override_reason else "",
                f" [canary run {self.canary_run_id}]" if self.canary_run_id else "",
            ]
        )
        return f"{self.at.isoformat(timespec='milliseconds')} {self.action} {what} by {self.by}: {self.reason}{extra}"


def version_label(version: str | None) -> str:
    """A version as people read it: v3, or none for an unset alias."""
    return f"v{version}" if version else UNSET


def experiment_id(mlflow_client) -> str:
    """Id of the audit experiment, created if missing (two first writers at once: one creates it)."""
    from mlflow.exceptions import MlflowException

    from registry import store

    try:
        return store.experiment_id(mlflow_client, AUDIT_EXPERIMENT, getattr(mlflow_client, "tracking_uri", None))
    except MlflowException as exc:
        if getattr(exc, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
            raise
        return mlflow_client.get_experiment_by_name(AUDIT_EXPERIMENT).experiment_id


def begin(
    mlflow_client,
    model: str,
    *,
    action: str,
    by: str,
    reason: str,
    at: datetime,
    op: str,
    step: int = 0,
    **fields: str | None,
) -> str:
    """Create the RUNNING audit run for one change; return its run id.

    `fields`: alias, from_version, to_version, version, override_reason, canary_run_id, ...
    (None values are left out, except from_version/to_version which are logged as "none").
    """
    from mlflow.entities import Param

    params = {
        "action": action,
        "model": model,
        "by": by,
        "at": at.isoformat(timespec="milliseconds"),
        "reason": reason[:MAX_TEXT],
        "op": op,
        "step": str(step),
    }
    for key, value in fields.items():
        if value is None and key in ("from_version", "to_version"):
            value = UNSET
        if value is not None:
            params[key] = str(value)[:MAX_TEXT]
    summary = (
        f"{action} {fields['alias']} {version_label(fields.get('from_version'))} -> "
        f"{version_label(fields.get('to_version'))}"
        if fields.get("alias")
        else f"{action} v{fields.get('version')}"
        if fields.get("version")
        else action
    )
    run = mlflow_client.create_run(
        experiment_id(mlflow_client),
        start_time=int(at.timestamp() * 1000),
        tags={"mlflow.user": by, "quantgate.action": action, "quantgate.model": model},
        run_name=f"{model}: {summary}",
    )
    mlflow_client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in params.items()])
    return run.info.run_id


@contextlib.contextmanager
def audited(mlflow_client, model: str, *, steps: Sequence[dict] = ({},), **common) -> Iterator[list[str]]:
    """An audited change: one RUNNING audit run per step (`begin(**common, step=i, **steps[i])`) before the
    block, all ended FINISHED when the block completes, or FAILED (and the error re-raised) when it raises.
    Yields the run ids."""
    run_ids = [begin(mlflow_client, model, step=i, **common, **fields) for i, fields in enumerate(steps)]
    try:
        yield run_ids
    except BaseException:
        for run_id in run_ids:
            end(mlflow_client, run_id, ok=False)
        raise
    for run_id in run_ids:
        end(mlflow_client, run_id, ok=True)


def end(mlflow_client, run_id: str, ok: bool) -> None:
    """Mark an audit run FINISHED (the change happened) or FAILED (it did not)."""
    with contextlib.redirect_stdout(io.StringIO()):  # MLflow prints "View run ... at: <url>" for a server
        mlflow_client.set_terminated(run_id, status="FINISHED" if ok else "FAILED")


def _event(run) -> Event:
    p = run.data.params

    def opt(key: str) -> str | None:
        value = p.get(key)
        return None if value in (None, UNSET) else value

    return Event(
        at=datetime.fromisoformat(p["at"]),
        action=p["action"],
        model=p["model"],
        by=p["by"],
        reason=p.get("reason", ""),
        alias=opt("alias"),
        from_version=opt("from_version"),
        to_version=opt("to_version"),
        version=opt("version"),
        override_reason=opt("override_reason"),
        canary_run_id=opt("canary_run_id"),
        step=int(p.get("step", 0)),
        run_id=run.info.run_id,
        done_at=datetime.fromtimestamp(run.info.end_time / 1000, timezone.utc) if run.info.end_time else None,
    )


def history(mlflow_client, model: str) -> list[Event]:
    """Every completed change to `model`'s aliases and approvals, oldest first (empty if none)."""
    exp = mlflow_client.get_experiment_by_name(AUDIT_EXPERIMENT)
    if exp is None:
        return []
    runs, token = [], None
    while True:
        page = mlflow_client.search_runs(
            [exp.experiment_id],
            page_token=token,
            max_results=1000,
            filter_string=f"params.model = '{model}' and attributes.status = 'FINISHED'",
        )
        runs.extend(page)
        token = page.token
        if not token:
            break
    return sorted((_event(r) for r in runs), key=lambda e: (e.at, e.step))
