"""A per-model lock held in the MLflow registry itself, so every alias or approval change is serialised.

MLflow has no conditional alias update, but registered model names are unique in every
backend (the primary key of the sqlite/PostgreSQL table behind a local store or an `mlflow
server`): creating the registered model `<model>.quantgate-lock` either succeeds (acquired)
or fails with RESOURCE_ALREADY_EXISTS (someone else holds it). Deleting it releases it.
The lock carries tags lock.holder, lock.pid, lock.host, lock.at (UTC ISO) and lock.token.

A lock older than STALE_AFTER_S (by its registry creation time) belongs to a process that
died; the next caller breaks it by renaming it to a unique name (only one breaker can rename
it), checking that it renamed the lock it judged stale, and deleting it; it says so on stderr
and records an audit run (action break_lock, naming the dead holder). Clocks are assumed
to agree to well under STALE_AFTER_S (NTP). By hand: delete registered model
`<model>.quantgate-lock` in the UI once you know its holder is gone.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone

from quantgate.errors import QuantgateError
from registry import audit

LOCK_SUFFIX = ".quantgate-lock"
STALE_AFTER_S = 120.0  # seconds; any change under the lock takes seconds
WAIT_S = 15.0  # seconds a caller waits for a held lock before giving up
POLL_S = 0.2


class LockBusy(QuantgateError):
    """Another quantgate process holds the model's lock and did not release it in time."""


class LockWaitStopped(LockBusy):
    """The caller's stop was set (Ctrl-C, SIGTERM) while it waited for a held lock; nothing was changed."""


def lock_name(model_name: str) -> str:
    return model_name + LOCK_SUFFIX


def is_lock(model_name: str) -> bool:
    """True for the registered models quantgate uses as locks (hidden from listings)."""
    return model_name.endswith(LOCK_SUFFIX) or LOCK_SUFFIX + ".stale." in model_name


def _code(exc) -> str:
    return getattr(exc, "error_code", "") or ""


def holder_of(mlflow_client, model_name: str) -> dict | None:
    """Tags of the lock on `model_name` plus `age_s` (seconds), or None when it is free."""
    from mlflow.exceptions import MlflowException

    try:
        rm = mlflow_client.get_registered_model(lock_name(model_name))
    except MlflowException as exc:
        if _code(exc) == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    created = datetime.fromtimestamp(rm.creation_timestamp / 1000, timezone.utc).isoformat(timespec="milliseconds")
    return {**rm.tags, "age_s": time.time() - rm.creation_timestamp / 1000, "created": created}


def _describe(tags: dict) -> str:
    """The holder, its lock.at tag (its own clock) and the registry's creation time, which staleness uses."""
    return (
        f"{tags.get('lock.holder', '?')} (pid {tags.get('lock.pid', '?')} on {tags.get('lock.host', '?')}, "
        f"lock.at {tags.get('lock.at', '?')}, created {tags.get('created', '?')} in the registry, "
        f"{tags.get('age_s', 0):.0f} s ago)"
    )


@dataclass
class Lock:
    """A held lock; `check()` raises if it was broken as stale while held."""

    client: object
    model_name: str
    token: str

    def check(self) -> None:
        tags = holder_of(self.client, self.model_name)
        if tags is None or tags.get("lock.token") != self.token:
            raise QuantgateError(
                f"lost the registry lock {lock_name(self.model_name)} (broken as stale after "
                f"{STALE_AFTER_S:.0f} s?); nothing was changed; retry"
            )

    def release(self) -> None:
        """Delete the lock if it is still ours (a lock broken as stale is left to its new holder)."""
        from mlflow.exceptions import MlflowException

        tags = holder_of(self.client, self.model_name)
        if tags is not None and tags.get("lock.token") == self.token:
            try:
                self.client.delete_registered_model(lock_name(self.model_name))
            except MlflowException as exc:
                if _code(exc) != "RESOURCE_DOES_NOT_EXIST":
                    raise


def _break_stale(mlflow_client, model_name: str, stale: dict, by: str, stale_after_s: float) -> None:
    """Rename the stale lock away (atomic: one breaker wins), delete it, say so on stderr and
    record it as an audit run (action break_lock): its holder died mid-change.

    If what we renamed is not the lock we judged stale (it was replaced in between), put it
    back; the caller retries acquiring.
    """
    from mlflow.exceptions import MlflowException

    stale_token = stale.get("lock.token", "")
    name = lock_name(model_name)
    grave = f"{name}.stale.{uuid.uuid4().hex[:12]}"
    try:
        mlflow_client.rename_registered_model(name, grave)
    except MlflowException as exc:
        if _code(exc) in ("RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS"):
            return  # someone else broke or released it
        raise
    if mlflow_client.get_registered_model(grave).tags.get("lock.token", "") != stale_token:
        try:
            mlflow_client.rename_registered_model(grave, name)
            return
        except MlflowException:
            pass  # a third process took the name meanwhile; the renamed lock's holder fails its check()
    mlflow_client.delete_registered_model(grave)
    reason = (
        f"stale registry lock of {_describe(stale)} broken after {stale_after_s:.0f} s: its process died "
        f"mid-change; check the aliases and approvals"
    )
    print(f"warning: {model_name}: broke a {reason}", file=sys.stderr, flush=True)
    with audit.audited(
        mlflow_client, model_name, action="break_lock", by=by, reason=reason, at=audit.utc_now(), op=uuid.uuid4().hex
    ):
        pass


def acquire(
    mlflow_client,
    model_name: str,
    holder: str,
    wait_s: float = WAIT_S,
    stale_after_s: float = STALE_AFTER_S,
    by: str | None = None,
    token: str | None = None,
    stop=None,
) -> Lock:
    """Take the lock on `model_name` for `holder` (a description, e.g. "promote v3 by alice"),
    waiting up to `wait_s` seconds; `by` (default `holder`) is who is recorded if a stale lock is broken;
    `token` (default: a new one) is what the lock carries, so a caller can release it even when an interrupt
    lands between its creation and this function's return (held); `stop` (a threading.Event, optional) set while
    the lock is held by another ends the wait at once.

    Raises LockBusy (a QuantgateError) naming the holder when it stays held, LockWaitStopped (a LockBusy) when
    `stop` was set while waiting.
    """
    from mlflow.exceptions import MlflowException

    token = token or uuid.uuid4().hex
    deadline = time.monotonic() + wait_s
    while True:
        tags = {
            "quantgate.lock": "true",
            "lock.holder": holder,
            "lock.token": token,
            "lock.pid": str(os.getpid()),
            "lock.host": socket.gethostname(),
            "lock.at": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        }
        try:
            mlflow_client.create_registered_model(
                lock_name(model_name),
                tags=tags,
                description=f"quantgate lock for {model_name}: an alias or approval change is in progress",
            )
            return Lock(mlflow_client, model_name, token)
        except MlflowException as exc:
            # ALREADY_EXISTS: held; DOES_NOT_EXIST: released between the insert and MLflow's re-read
            if _code(exc) not in ("RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST"):
                raise
        current = holder_of(mlflow_client, model_name)
        if current is None:
            continue
        if current["age_s"] > stale_after_s:
            _break_stale(mlflow_client, model_name, current, by or holder, stale_after_s)
            continue
        if stop is not None and stop.is_set():
            raise LockWaitStopped(
                f"{model_name}: stopped while waiting for the registry lock held by {_describe(current)}; "
                f"nothing was changed"
            )
        if time.monotonic() > deadline:
            raise LockBusy(
                f"{model_name}: another alias/approval change holds the registry lock: {_describe(current)}; "
                f"retry later (a lock older than {stale_after_s:.0f} s is broken automatically, or delete "
                f"registered model {lock_name(model_name)!r} once its holder is gone)"
            )
        pause = POLL_S * (0.5 + random.random())
        if stop is not None:
            stop.wait(pause)
        else:
            time.sleep(pause)


@contextmanager
def held(
    mlflow_client, model_name: str, holder: str, wait_s: float = WAIT_S, by: str | None = None, stop=None
) -> Iterator[Lock]:
    """`with held(client, model, what, by=who) as lock:` acquire, run, release (also on error). An interrupt
    (Ctrl-C) while the lock is being taken releases it too: its token is chosen here, before it exists, and
    release() deletes only a lock carrying it (it once stayed held until broken as stale, blocking rollbacks).
    `stop`: see acquire."""
    token = uuid.uuid4().hex
    try:
        yield acquire(mlflow_client, model_name, holder, wait_s, by=by, token=token, stop=stop)
    finally:
        Lock(mlflow_client, model_name, token).release()
