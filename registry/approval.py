"""Release approval of a model version: tags on the version, read fail-closed.

Tags (set by `quantgate approve/revoke`, or by a release manager in the MLflow UI):
  approval                  "approved" or "revoked"
  approval.by               who decided (required for an approval to count)
  approval.reason           why (required for an approval to count)
  approval.at               when, UTC ISO (written by the CLI; optional in the UI)
  approval.override_reason  required when the version's gate.verdict is not PASS/BASELINE
A version counts as approved only when approval=approved, by and reason are filled in, and
gate.verdict is PASS or BASELINE or an override reason is recorded. The verdict is the one
recorded as a param of the build's run at registration (registry.versions.recorded_verdict);
a gate.verdict tag that differs from it (edited in the UI) makes the version NOT approved.
Versions registered before the param existed have only the tag, which is read as before; a
version whose run is gone (purged by `mlflow gc`) has lost its record and is NOT approved.
Anything else (missing, revoked, an unknown value, an override missing) reads as NOT
approved, with the reason why.
The CLI also records each approve/revoke as an audit run; a UI edit is not audited.

The gate's recommendation (tags `recommended` yes/no/baseline and `recommendation`, registry/tags.py: PASS
for every team AND cheaper to serve than the 16-bit build where it was measured) is a separate field: it
never makes or blocks an approval. A release manager may override a "no" with a reason
(`quantgate approve ... --recommend REASON`): tags recommendation.override_{by,reason,at}, audited.
"""

from __future__ import annotations

import uuid
from contextlib import contextmanager
from dataclasses import dataclass, replace

from quantgate.errors import QuantgateError
from registry import audit, lock, versions
from registry.tags import BASELINE, PASSING, RECOMMENDATION, RECOMMENDED, VERDICT

TAG, BY, REASON, AT, OVERRIDE = "approval", "approval.by", "approval.reason", "approval.at", "approval.override_reason"
APPROVED, REVOKED = "approved", "revoked"
MAX_NAME = 250  # characters of a name (--by); MLflow's own limit on keys and user names
RECO_BY, RECO_REASON, RECO_AT = (
    "recommendation.override_by",
    "recommendation.override_reason",
    "recommendation.override_at",
)


@dataclass(frozen=True)
class Approval:
    """What the tags say. `approved` is the only field that gates anything."""

    approved: bool
    state: str  # approved | revoked | none | invalid
    why: str
    by: str | None = None
    at: str | None = None
    reason: str | None = None
    override_reason: str | None = None
    unchanged: bool = False  # approve() found this very approval already recorded and wrote nothing
    was: str | None = None  # revoke(): the state it revoked (none: never approved, the revocation is a veto)

    @property
    def override(self) -> bool:
        return self.approved and self.override_reason is not None


def read_approval(tags: dict[str, str], recorded: str | None) -> Approval:
    """Approval state of a version from its tags and `recorded`, the gate verdict its run
    recorded at registration (registry.versions.recorded_verdict; None if none): fail closed,
    see the module docstring."""

    def text(key: str) -> str | None:
        return (tags.get(key) or "").strip() or None

    raw, by, at, reason, override = text(TAG), text(BY), text(AT), text(REASON), text(OVERRIDE)
    verdict = tags.get(VERDICT, "missing")
    who = dict(by=by, at=at, reason=reason)
    if raw is None:
        return Approval(False, "none", "not approved (no `approval` tag)", **who)
    state = raw  # exact: a near-miss like "Approved" is not an approval (fail closed)
    if state == REVOKED:
        return Approval(
            False, "revoked", f"revoked by {by or '?'} at {at or '?'}: {reason or 'no reason given'}", **who
        )
    if state != APPROVED:
        return Approval(
            False, "invalid", f"not approved: tag approval={raw!r} is neither {APPROVED!r} nor {REVOKED!r}", **who
        )
    if by is None or reason is None:
        missing = [k for k, v in ((BY, by), (REASON, reason)) if v is None]
        return Approval(
            False,
            "invalid",
            f"not approved: approval={APPROVED} but {' and '.join(missing)} "
            f"{'are' if len(missing) > 1 else 'is'} empty "
            f"(an approval must say who and why)",
            **who,
        )
    if (problem := verdict_problem(tags.get(VERDICT), recorded)) is not None:
        return Approval(False, "invalid", f"not approved: {problem}", **who)
    if verdict in PASSING:
        return Approval(True, "approved", f"approved by {by} at {at or '?'}: {reason}", **who)
    if override is None:
        return Approval(
            False,
            "invalid",
            f"not approved: approval={APPROVED} by {by} but gate.verdict={verdict} and no "
            f"{OVERRIDE} (a build that did not pass its gate needs a recorded override)",
            **who,
        )
    return Approval(
        True,
        "approved",
        f"approved by {by} at {at or '?'} OVERRIDING gate.verdict={verdict}: {override}",
        override_reason=override,
        **who,
    )


def verdict_problem(tag: str | None, recorded: str | None) -> str | None:
    """Why a version's gate.verdict `tag` cannot be trusted, or None when it is the verdict its
    run recorded at registration, or when there is no record (a version registered before
    quantgate recorded it: its tag is all there is, and is read as before)."""
    if recorded is None or tag == recorded:
        return None
    if recorded.startswith(versions.GONE):
        return (
            f"the build's run {recorded.removeprefix(versions.GONE)} is gone (purged by `mlflow gc`?), so the "
            f"verdict it recorded cannot be read and the gate.verdict tag ({tag or 'missing'}) is not trusted; "
            f"register the build again (`dvc repro`)"
        )
    shown = "missing" if tag is None else repr(tag)
    return (
        f"tag gate.verdict is {shown} but the build's run recorded {recorded!r} at registration (the tag was "
        f"changed after registration and does not count; set it back to {recorded})"
    )


def approval_of(mlflow_client, model_name: str, version) -> Approval:
    """Approval state of an existing READY version (QuantgateError if it is missing)."""
    mv = versions.require_version(mlflow_client, model_name, version)
    return read_approval(mv.tags, versions.recorded_verdict(mlflow_client, mv))


def check_length(**values: str | None) -> None:
    """QuantgateError naming the first option that is longer than the registry keeps (None is fine).

    Checked before anything is written: a name (--by) goes into the lock's registered-model tag
    and the audit run's user tag, free text into audit params (MLflow keeps 6000 characters; the
    registered-model tag column is varchar(5000) on PostgreSQL), so nothing is cut or half-written.
    """
    for name, value in values.items():
        if (problem := length_problem(name, value)) is not None:
            raise QuantgateError(f"--{name} is {problem}")


def length_problem(name: str, value: str | None) -> str | None:
    """Why option --`name`'s `value` is longer than the registry keeps, and the fix, worded to follow the option's
    name (`6000 characters; the registry keeps at most 250: ...`); None when it fits (or is None)."""
    limit = MAX_NAME if name == "by" else audit.MAX_TEXT
    if value is None or len(value) <= limit:
        return None
    # a name is shortened; free text can point to where the whole of it lives
    fix = "give a shorter name, e.g. --by alice" if name == "by" else "shorten it (link to a longer document)"
    return f"{len(value)} characters; the registry keeps at most {limit}: {fix}"


def require_text(**values: str | None) -> None:
    """QuantgateError naming the first option (--by, --reason, ...) that is empty, blank or too long."""
    for name, value in values.items():
        if not (value or "").strip():
            hint = ": name who is acting, e.g. --by alice (it defaults to $USER)" if name == "by" else ""
            raise QuantgateError(f"--{name} must not be empty{hint}")
    check_length(**values)


def approve(
    mlflow_client, model_name: str, version, by: str, reason: str, override_reason: str | None = None
) -> Approval:
    """Approve `version` for serving; return the approval as read back.

    A version whose gate.verdict is not PASS/BASELINE needs `override_reason`, which is
    recorded (tag and audit run); for a passing version it is not needed and not recorded.
    Idempotent: the same approval (by, reason, override) of an approved version writes
    nothing and returns it with `unchanged=True`, so a retried command leaves one audit event.
    Raises QuantgateError when the version is missing or the override is missing.
    """
    require_text(by=by, reason=reason)
    check_length(override=override_reason)
    with lock.held(mlflow_client, model_name, f"approve by {by}", by=by) as lk:
        mv = versions.require_version(mlflow_client, model_name, version)
        verdict, recorded = mv.tags.get(VERDICT, "missing"), versions.recorded_verdict(mlflow_client, mv)
        if (problem := verdict_problem(mv.tags.get(VERDICT), recorded)) is not None:
            raise QuantgateError(f"{model_name} v{mv.version}: {problem}")
        if verdict in PASSING:
            override_reason = None
        elif not (override_reason or "").strip():
            raise QuantgateError(
                f"{model_name} v{mv.version}: gate.verdict is {verdict}, not PASS; approving it "
                f"needs --override REASON, which is recorded"
            )
        current = read_approval(mv.tags, recorded)
        if current.approved and (current.by, current.reason, current.override_reason) == (
            by.strip(),
            reason.strip(),
            (override_reason or "").strip() or None,
        ):
            return replace(current, unchanged=True)
        at = audit.utc_now()
        with audit.audited(
            mlflow_client,
            model_name,
            action="approve",
            by=by,
            reason=reason,
            at=at,
            op=uuid.uuid4().hex,
            version=mv.version,
            override_reason=override_reason,
        ):
            lk.check()
            writes = {BY: by, REASON: reason, AT: at.isoformat(timespec="milliseconds"), OVERRIDE: override_reason}
            writes[TAG] = APPROVED  # last: counts only when complete
            _write_all(mlflow_client, model_name, mv, writes)
    return approval_of(mlflow_client, model_name, mv.version)


@contextmanager
def _version_change(mlflow_client, model_name: str, version, by: str, reason: str, action: str):
    """An audited change of one READY version under the registry lock: yields (the version, the change's UTC time);
    the block writes the tags. Raises QuantgateError for a missing version or a lock held by another change."""
    with lock.held(mlflow_client, model_name, f"{action} by {by}", by=by) as lk:
        mv = versions.require_version(mlflow_client, model_name, version)
        at = audit.utc_now()
        op = uuid.uuid4().hex
        with audit.audited(
            mlflow_client, model_name, action=action, by=by, reason=reason, at=at, op=op, version=mv.version
        ):
            lk.check()
            yield mv, at


def revoke(mlflow_client, model_name: str, version, by: str, reason: str) -> Approval:
    """Revoke the approval of `version` (also a veto on a version never approved).

    Aliases are not moved: revoking the production version leaves it serving until a
    rollback (`quantgate rollback`), but it can no longer be promoted or made candidate, nor be
    a rollback's target. The returned Approval's `was` is the state revoked (none: a veto).
    """
    require_text(by=by, reason=reason)
    with _version_change(mlflow_client, model_name, version, by, reason, "revoke") as (mv, at):
        was = read_approval(mv.tags, versions.recorded_verdict(mlflow_client, mv)).state
        writes = {TAG: REVOKED}  # first: fail closed
        writes.update({BY: by, REASON: reason, AT: at.isoformat(timespec="milliseconds"), OVERRIDE: None})
        _write_all(mlflow_client, model_name, mv, writes)
    return replace(approval_of(mlflow_client, model_name, mv.version), was=was)


def _write_all(mlflow_client, model_name: str, mv, writes: dict[str, str | None]) -> None:
    """Set (None: delete) the approval tags in order; if one write fails, put back every tag
    already written as it was on `mv`, so the version never reads half of two approvals."""
    done: list[str] = []
    try:
        for key, value in writes.items():
            _set_tag(mlflow_client, model_name, mv.version, key, value, present=key in mv.tags)
            done.append(key)
    except BaseException:
        for key in sorted(done, key=lambda k: k == TAG):  # the approval tag last, once the rest is back
            try:
                _set_tag(mlflow_client, model_name, mv.version, key, mv.tags.get(key), present=True)
            except Exception:  # best effort; the original error is what matters
                pass
        raise


def _set_tag(mlflow_client, model_name: str, version: str, key: str, value: str | None, present: bool) -> None:
    if value is not None:
        mlflow_client.set_model_version_tag(model_name, version, key, value)
    elif present:
        mlflow_client.delete_model_version_tag(model_name, version, key)


def read_recommendation(tags: dict[str, str]) -> tuple[str, str]:
    """(short cell, one line) for a version's recommendation: "yes" / "no" / "baseline" as the gate recorded
    it, "override" when a release manager overrode a "no" (who and why), "-" when none was recorded (a version
    registered before builds were profiled)."""
    gate_says, why = tags.get(RECOMMENDED), tags.get(RECOMMENDATION, "")
    by, reason = (tags.get(RECO_BY) or "").strip(), (tags.get(RECO_REASON) or "").strip()
    if by and reason:
        said = "recorded no recommendation" if gate_says is None else f"said {gate_says}" + (f": {why}" if why else "")
        return "override", f"recommended by {by}'s override: {reason} (the gate {said})"
    if gate_says is None:
        return "-", "no recommendation recorded (registered before builds were profiled)"
    if gate_says == "baseline":
        return "baseline", "the 16-bit baseline: the builds are priced against it"
    return gate_says, f"{'recommended' if gate_says == 'yes' else 'not recommended'}: {why}"


def recommend_problem(tags: dict[str, str]) -> str | None:
    """Why a version's recommendation cannot be overridden (the 16-bit baseline: the builds are priced against
    it), or None."""
    if tags.get(RECOMMENDED) == "baseline" or tags.get(VERDICT) == BASELINE:
        return (
            "it is the 16-bit baseline (gate.verdict=BASELINE): the builds are priced against it, so it has no "
            "recommendation to override; drop --recommend"
        )
    return None


def override_recommendation(mlflow_client, model_name: str, version, by: str, reason: str) -> tuple[str, str]:
    """Record that `by` recommends `version` whatever the gate's cost policy said, and why (tags and an audit
    run); return read_recommendation of the version afterwards. Raises QuantgateError for a missing version,
    the 16-bit baseline (`recommend_problem`) or an empty --by / reason."""
    require_text(by=by, recommend=reason)
    mv = versions.require_version(mlflow_client, model_name, version)
    if (problem := recommend_problem(mv.tags)) is not None:  # before the lock and the audit run
        raise QuantgateError(f"{model_name} v{mv.version}: --recommend refused: {problem}")
    with _version_change(mlflow_client, model_name, version, by, reason, "recommend") as (mv, at):
        writes = {RECO_BY: by, RECO_REASON: reason, RECO_AT: at.isoformat(timespec="milliseconds")}
        _write_all(mlflow_client, model_name, mv, writes)
    return read_recommendation(versions.require_version(mlflow_client, model_name, mv.version).tags)
