"""Moving the serving aliases: promote, rollback, candidate, fallback; each change audited.

Aliases (the only ones quantgate sets; MLflow reserves `latest` and `v<digits>`):
  production  what serves traffic
  previous    the production before the current one, while it is still a known-good
              build to return to (cleared when it becomes production again)
  candidate   the build in canary
  fallback    the 16-bit baseline build (gate.verdict=BASELINE), set by `dvc repro`
Every change runs under the model's registry lock (registry/lock.py) and re-reads the
aliases there, so a caller's view is checked and applied in one step: two concurrent
promotions cannot both win. Each alias change is an audit run (registry/audit.py), and an
alias is only ever pointed at an existing READY version.
"""

from __future__ import annotations

import re
import tempfile
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from quantgate.errors import QuantgateError
from registry import approval, audit, lock, tags, versions
from registry.approval import require_text as _require_text
from registry.audit import version_label
from registry.verify import verify_version

PRODUCTION, PREVIOUS, CANDIDATE, FALLBACK = "production", "previous", "candidate", versions.FALLBACK
ALIASES = (PRODUCTION, PREVIOUS, CANDIDATE, FALLBACK)


class AliasConflict(QuantgateError):
    """The aliases are not what the caller expected (someone else changed them first)."""


def check_alias(name: str) -> str:
    """`name` if it is one of ALIASES; QuantgateError otherwise (reserved names say so)."""
    if name in ALIASES:
        return name
    if name.lower() == "latest" or re.fullmatch(r"v\d+", name, flags=re.IGNORECASE):
        raise QuantgateError(f"alias {name!r} is reserved by MLflow; quantgate sets only {', '.join(ALIASES)}")
    raise QuantgateError(f"unknown alias {name!r}; quantgate sets only {', '.join(ALIASES)}")


@dataclass(frozen=True)
class Change:
    alias: str
    from_version: str | None
    to_version: str | None  # None: the alias is removed

    def __str__(self) -> str:
        return f"{self.alias}: {version_label(self.from_version)} -> {version_label(self.to_version)}"


def current(mlflow_client, model_name: str) -> dict[str, str]:
    """{alias: version} of quantgate's aliases on `model_name` (QuantgateError if not registered)."""
    rm = versions.registered_model(mlflow_client, model_name)
    return {a: str(v) for a, v in (rm.aliases or {}).items() if a in ALIASES}


def _apply(
    mlflow_client,
    model_name: str,
    held: lock.Lock,
    changes: list[Change],
    *,
    action: str,
    by: str,
    reason: str,
    canary_run_id: str | None = None,
    **extra: str | None,
) -> list[Change]:
    """Write `changes` (under `held`) with one audit run each; on failure restore what was written."""
    at, op = audit.utc_now(), uuid.uuid4().hex
    for c in changes:
        check_alias(c.alias)
        if c.to_version is not None:
            versions.require_version(mlflow_client, model_name, c.to_version)
    steps = [
        dict(
            alias=c.alias,
            from_version=c.from_version,
            to_version=c.to_version,
            canary_run_id=canary_run_id,
            **(extra if c.alias == PRODUCTION else {}),
        )
        for c in changes
    ]
    done: list[Change] = []
    with audit.audited(mlflow_client, model_name, steps=steps, action=action, by=by, reason=reason, at=at, op=op):
        try:
            held.check()
            for c in changes:
                _set(mlflow_client, model_name, c.alias, c.to_version)
                done.append(c)
        except BaseException:
            for c in reversed(done):
                try:
                    _set(mlflow_client, model_name, c.alias, c.from_version)
                except Exception:  # best effort; the original error is what matters
                    pass
            raise
    return changes


def _set(mlflow_client, model_name: str, alias: str, version: str | None) -> None:
    if version is None:
        mlflow_client.delete_registered_model_alias(model_name, alias)
    else:
        mlflow_client.set_registered_model_alias(model_name, alias, version)


def _require_servable(mlflow_client, model_name: str, version: str) -> approval.Approval:
    """Existing, READY and approved (gate PASS/BASELINE or a recorded override)."""
    a = approval.approval_of(mlflow_client, model_name, version)
    if not a.approved:
        raise QuantgateError(
            f"{model_name} v{version} is not approved for serving: {a.why}; "
            f"`quantgate approve {model_name} {version} --reason ...` first"
        )
    return a


def _exists(mlflow_client, model_name: str, version: str) -> bool:
    """Whether `model_name` has version `version` (in any status)."""
    return versions.get_version(mlflow_client, model_name, version) is not None


def _verified(mlflow_client, model_name: str, version: str) -> None:
    with tempfile.TemporaryDirectory(prefix="quantgate-verify-") as tmp:
        verify_version(mlflow_client, model_name, version, Path(tmp))


# How canary/controller.py records a canary (canary/status.py; registry/ does not import canary/): a run in
# this experiment, tagged model, candidate_version and canary.phase, and outcome once it ended.
CANARY_EXPERIMENT = "quantgate-canary"
PASSED = ("promoting", "promoted")  # passed every step (promoting: the controller's own promote, in progress)
STARTING = ("initializing", "progressing")  # a canary setting `candidate` is still running


def _run_kind(mlflow_client, run) -> str | None:
    """What `run` is when it is not a canary run ("an audit run (action promote)", ...), else None."""
    exp = mlflow_client.get_experiment(run.info.experiment_id)
    if exp.name == CANARY_EXPERIMENT:
        return None
    t, p = run.data.tags, run.data.params
    if exp.name == audit.AUDIT_EXPERIMENT:
        return f"an audit run (action {p.get('action', '?')})"
    if tags.BUILD in t:
        return f"a build run (build {t[tags.BUILD]})"
    return f"a run of experiment {exp.name!r}"


def _require_canary_run(
    mlflow_client, run_id: str | None, model_name: str, version: str, phases: tuple[str, ...]
) -> None:
    """QuantgateError unless run `run_id` (None: no run given) is a canary run of `model_name` v`version`
    whose canary.phase is one of `phases` (PASSED for a promotion, STARTING for `candidate`)."""
    from mlflow.exceptions import MlflowException

    if run_id is None:
        return
    use = "give the run id `quantgate canary run` printed for this version"
    try:
        run = mlflow_client.get_run(run_id)
    except MlflowException as exc:  # the run missing, or no run id at all ('../x'); else the registry failed
        if getattr(exc, "error_code", "") not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise
        raise QuantgateError(f"canary run {run_id!r} does not exist at this tracking URI; {use}") from None
    if (kind := _run_kind(mlflow_client, run)) is not None:
        raise QuantgateError(f"canary run {run_id} is {kind}, not a canary run ({CANARY_EXPERIMENT}); {use}")
    t = run.data.tags
    of = (t.get("model"), t.get("candidate_version"))
    if None in of:
        missing = " and ".join(k for k, v in zip(("model", "candidate_version"), of, strict=True) if v is None)
        raise QuantgateError(
            f"canary run {run_id} in {CANARY_EXPERIMENT} has no {missing} tag, so it is no canary `quantgate canary "
            f"run` recorded; {use}"
        )
    if of != (model_name, version):
        raise QuantgateError(
            f"canary run {run_id} is the canary of {of[0]} v{of[1]}, not of {model_name} v{version}; {use}"
        )
    phase = t.get("canary.phase")
    if run.info.lifecycle_stage != "active":
        state = "deleted"
    elif t.get("outcome") == "aborted" or phase == "aborted":
        state = f"aborted ({t.get('outcome.reason', 'no reason recorded')})"
    else:
        state = f"in phase {phase}" if phase else "without a canary.phase tag"
    if state.startswith("in phase ") and phase in phases:
        return
    need = "passed every step" if phases == PASSED else "is running"
    raise QuantgateError(
        f"canary run {run_id} of {model_name} v{version} is {state}; only a canary that {need} "
        f"(canary.phase {' or '.join(phases)}) can be given"
    )


def promote(
    mlflow_client,
    model_name: str,
    version,
    expected_production,
    by: str,
    reason: str,
    canary_run_id: str | None = None,
    verify: bool = True,
    stop=None,
) -> list[Change]:
    """Make `version` production if production is still `expected_production` (a version or None).

    The old production (or, when there was none, the `fallback` build that served) becomes
    `previous`; `candidate` is cleared if it was `version`.
    `version` must be approved and (verify=True) its artifacts must match its weight tags;
    `canary_run_id`, when given, must be a canary run of this version that passed every step.
    `stop` (a threading.Event, e.g. the canary's Ctrl-C) set before the alias change or while it waits for the
    registry lock ends it with registry.lock.LockWaitStopped, nothing changed.
    Raises AliasConflict when production is not `expected_production` (nothing changes),
    QuantgateError when `expected_production` does not exist, or `version` is missing, not approved or
    its weights do not verify.
    Returns the alias changes made (empty when `version` already is production).
    """
    _require_text(by=by, reason=reason)
    version = versions.version_number(version)
    expected = None if expected_production is None else versions.version_number(expected_production)
    _require_servable(mlflow_client, model_name, version)
    _require_canary_run(mlflow_client, canary_run_id, model_name, version, PASSED)
    if verify:
        _verified(mlflow_client, model_name, version)  # slow (download): before taking the lock
    if stop is not None and stop.is_set():
        raise lock.LockWaitStopped(f"{model_name}: stopped before promoting v{version}; nothing was changed")
    with lock.held(mlflow_client, model_name, f"promote v{version} by {by}", by=by, stop=stop) as held:
        now = current(mlflow_client, model_name)
        prod = now.get(PRODUCTION)
        if prod != expected and expected is not None and not _exists(mlflow_client, model_name, expected):
            raise QuantgateError(
                f"{model_name} v{expected}, the production you expected, does not exist (never registered, or "
                f"deleted); production is {version_label(prod)}: give --expect-production {prod or 'none'} "
                f"(see `quantgate status {model_name}`); nothing was changed"
            )
        if prod != expected:
            raise AliasConflict(
                f"{model_name}: production is {version_label(prod)}, not {version_label(expected)} as expected; "
                f"someone else changed it first (see `quantgate history {model_name}`); nothing was changed"
            )
        if prod == version:
            return []
        a = _require_servable(mlflow_client, model_name, version)  # again: a revoke may have just landed
        changes = [Change(PRODUCTION, prod, version)]
        served = prod or now.get(FALLBACK)  # with no production, the fallback build was serving
        if served is not None and served != version and now.get(PREVIOUS) != served:
            changes.append(Change(PREVIOUS, now.get(PREVIOUS), served))
        if now.get(CANDIDATE) == version:
            changes.append(Change(CANDIDATE, version, None))
        return _apply(
            mlflow_client,
            model_name,
            held,
            changes,
            action="promote",
            by=by,
            reason=reason,
            canary_run_id=canary_run_id,
            approved_by=a.by,
            override_reason=a.override_reason,
        )


def rollback(
    mlflow_client, model_name: str, by: str, reason: str, to: str = PREVIOUS, verify: bool = True
) -> list[Change]:
    """Point production back at `previous` (default) or `fallback`.

    The version rolled away from is not kept in an alias (the audit trail names it; roll
    forward with `promote` once it is fixed and approved). After a rollback to `previous`,
    `previous` is cleared, so a second rollback cannot flip back to the bad build; after a
    rollback to `fallback`, `previous` is kept (unless it is the fallback itself).
    The target must exist, be READY, not be revoked, and (verify=True) match its weight tags;
    approval is not required (the previous build was approved when promoted, the fallback is
    the baseline). Raises QuantgateError if there is no production or nothing to go back to.
    """
    _require_text(by=by, reason=reason)
    if to not in (PREVIOUS, FALLBACK):
        raise QuantgateError(f"rollback goes to {PREVIOUS!r} or {FALLBACK!r}, not {to!r}")
    target = current(mlflow_client, model_name).get(to)
    if verify and target is not None:
        _verified(mlflow_client, model_name, target)
    with lock.held(mlflow_client, model_name, f"rollback to {to} by {by}", by=by) as held:
        now = current(mlflow_client, model_name)
        prod = now.get(PRODUCTION)
        if prod is None:
            raise QuantgateError(f"{model_name} has no production alias: nothing to roll back")
        alt = _other_target(mlflow_client, model_name, now, to)
        if now.get(to) is None:
            hint = f"; `--to {alt[0]}` goes to {alt[1]}" if alt else _no_target(model_name)
            raise QuantgateError(f"{model_name} has no {to!r} alias: nothing to roll back to{hint}")
        if now.get(to) != target:
            raise AliasConflict(
                f"{model_name}: {to} moved from {version_label(target)} to {version_label(now.get(to))} "
                f"during the rollback; nothing was changed; retry"
            )
        if target == prod:
            hint = f"; `--to {alt[0]}` goes to {alt[1]}" if alt else _no_target(model_name)
            raise QuantgateError(f"{model_name}: {to} is v{target}, which already is production{hint}")
        if approval.approval_of(mlflow_client, model_name, target).state == approval.REVOKED:
            other = f"`quantgate rollback {model_name} --to {alt[0]}` ({alt[1]}), or " if alt else ""
            raise QuantgateError(
                f"{model_name} v{target} ({to}) has its approval revoked; go to another version: {other}"
                f"`quantgate promote {model_name} VERSION` with an approved one"
            )
        changes = [Change(PRODUCTION, prod, target)]
        if now.get(PREVIOUS) == target:
            changes.append(Change(PREVIOUS, target, None))
        return _apply(mlflow_client, model_name, held, changes, action="rollback", by=by, reason=reason)


def _other_target(mlflow_client, model_name: str, now: dict[str, str], to: str) -> tuple[str, str] | None:
    """(alias, what it is) of the other rollback target when a rollback to it would work (`_would_work`), else
    None: what a refused rollback to `to` may suggest."""
    other = FALLBACK if to == PREVIOUS else PREVIOUS
    if not _would_work(mlflow_client, model_name, now, other):
        return None
    return other, ("the 16-bit build" if other == FALLBACK else f"v{now[other]}")


def _would_work(mlflow_client, model_name: str, now: dict[str, str], alias: str) -> bool:
    """Whether `rollback --to alias` would be taken with the aliases `now`: the alias is set, is not production
    and its version is not revoked (rollback's own checks, bar the weights it verifies)."""
    v = now.get(alias)
    if v is None or v == now.get(PRODUCTION):
        return False
    return approval.approval_of(mlflow_client, model_name, v).state != approval.REVOKED


def rollback_targets(mlflow_client, model_name: str) -> list[str]:
    """The aliases a `rollback` would go to now, `previous` (its default) first, then `fallback`; empty when
    neither would work (unset, production itself, or revoked): then only a promote moves production."""
    now = current(mlflow_client, model_name)
    return [alias for alias in (PREVIOUS, FALLBACK) if _would_work(mlflow_client, model_name, now, alias)]


def _no_target(model_name: str) -> str:
    return f"; no other rollback target either: `quantgate promote {model_name} VERSION` with an approved one"


def set_candidate(
    mlflow_client, model_name: str, version, by: str, reason: str, canary_run_id: str | None = None, verify: bool = True
) -> list[Change]:
    """Point `candidate` (the canary) at an approved `version` whose weights verify; `canary_run_id`, when
    given, must be a running canary run of this version."""
    _require_text(by=by, reason=reason)
    version = versions.version_number(version)
    _require_servable(mlflow_client, model_name, version)
    _require_canary_run(mlflow_client, canary_run_id, model_name, version, STARTING)
    if verify:
        _verified(mlflow_client, model_name, version)
    with lock.held(mlflow_client, model_name, f"candidate v{version} by {by}", by=by) as held:
        now = current(mlflow_client, model_name)
        if now.get(CANDIDATE) == version:
            return []
        _require_servable(mlflow_client, model_name, version)
        return _apply(
            mlflow_client,
            model_name,
            held,
            [Change(CANDIDATE, now.get(CANDIDATE), version)],
            action="set_candidate",
            by=by,
            reason=reason,
            canary_run_id=canary_run_id,
        )


def clear_candidate(
    mlflow_client, model_name: str, by: str, reason: str, canary_run_id: str | None = None
) -> list[Change]:
    """Remove `candidate` (canary aborted or done); no-op when it is not set."""
    _require_text(by=by, reason=reason)
    with lock.held(mlflow_client, model_name, f"clear candidate by {by}", by=by) as held:
        old = current(mlflow_client, model_name).get(CANDIDATE)
        if old is None:
            return []
        return _apply(
            mlflow_client,
            model_name,
            held,
            [Change(CANDIDATE, old, None)],
            action="clear_candidate",
            by=by,
            reason=reason,
            canary_run_id=canary_run_id,
        )


def set_fallback(mlflow_client, model_name: str, version, by: str, reason: str) -> list[Change]:
    """Point `fallback` at the 16-bit baseline `version` (gate.verdict=BASELINE).

    No lock, no audit run when it already points there (every `dvc repro` calls this).
    """
    _require_text(by=by, reason=reason)
    version = versions.version_number(version)
    if current(mlflow_client, model_name).get(FALLBACK) == version:
        return []
    mv = versions.require_version(mlflow_client, model_name, version)
    recorded = versions.recorded_verdict(mlflow_client, mv)
    if mv.tags.get(tags.VERDICT) != tags.BASELINE or recorded not in (None, tags.BASELINE):
        raise QuantgateError(
            f"{model_name} v{version} is not the baseline build (gate.verdict="
            f"{recorded or mv.tags.get(tags.VERDICT, 'missing')}); {FALLBACK!r} is the 16-bit build"
        )
    with lock.held(mlflow_client, model_name, f"fallback v{version} by {by}", by=by) as held:
        old = current(mlflow_client, model_name).get(FALLBACK)
        if old == version:
            return []
        return _apply(
            mlflow_client,
            model_name,
            held,
            [Change(FALLBACK, old, version)],
            action="set_fallback",
            by=by,
            reason=reason,
        )


def aliases_at(mlflow_client, model_name: str, when: datetime) -> dict[str, str | None]:
    """{alias: version or None} for every alias at `when` (naive = UTC), per the audit trail.

    None before an alias's first audited change or while it was unset. Changes made outside
    quantgate (by hand in the UI) are not in the trail.
    """
    when = audit.as_utc(when)
    state: dict[str, str | None] = dict.fromkeys(ALIASES)
    for e in audit.history(mlflow_client, model_name):
        if e.at > when:
            break
        if e.alias in state:
            state[e.alias] = e.to_version
    return state


def alias_at(mlflow_client, model_name: str, alias: str, when: datetime) -> str | None:
    """The version `alias` pointed to at `when` (naive = UTC); see `aliases_at`."""
    check_alias(alias)
    return aliases_at(mlflow_client, model_name, when)[alias]
