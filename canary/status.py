"""A canary's persisted status: tags on its MLflow run (experiment `quantgate-canary`), like
Flagger's Canary .status, so another process can see, and clean up after, a controller that died.

    canary.phase          initializing | progressing | promoting | promoted | aborted
    canary.step           1-based step now (0 = before traffic)
    canary.weight         percent of traffic the controller has set
    canary.failed_checks  the checks that FAILed, comma-separated ("" = none)
    canary.controller     host:pid of the controller
    canary.heartbeat      epoch seconds of the controller's last look (every check_interval_s)
    canary.resumed        why the controller resumed a step (the gateway restarted), if it did
    canary.aborted        why the run was aborted by someone other than its controller
    canary.forecast       the latency checks the versions' profiles say it will likely fail (canary/forecast.py)

`live_run`: the canary of a model whose controller is beating, if any (one canary per model
at a time: a second `canary run` is refused while it lives).
`reap_stale`: a run still initializing, progressing or promoting whose heartbeat is older than
`stale_after_s` has lost its controller; it is recorded as aborted ("controller gone since
..."), and `candidate` is cleared when it still points at that run's version.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import UTC, datetime
from enum import Enum

from registry import aliases

EXPERIMENT = "quantgate-canary"
PREFIX = "canary."


class Phase(str, Enum):
    INITIALIZING = "initializing"
    PROGRESSING = "progressing"
    PROMOTING = "promoting"
    PROMOTED = "promoted"
    ABORTED = "aborted"


LIVE = (Phase.INITIALIZING.value, Phase.PROGRESSING.value)  # a controller should be beating
REAPED = (*LIVE, Phase.PROMOTING.value)  # phases a dead controller leaves behind


class Status:
    """The status tags of one canary run; `set(...)` writes them all with a fresh heartbeat."""

    def __init__(self, mlflow_client, run_id: str):
        self.client, self.run_id = mlflow_client, run_id
        self.fields: dict[str, str] = {
            "phase": Phase.INITIALIZING.value,
            "step": "0",
            "weight": "0",
            "failed_checks": "",
            "controller": f"{socket.gethostname()}:{os.getpid()}",
        }

    @classmethod
    def of(cls, mlflow_client, run_id: str, tags: dict[str, str]) -> Status:
        """The status a run's `tags` record (its phase, step, weight, failed checks and controller), to write on."""
        status = cls(mlflow_client, run_id)
        status.fields.update({k: tags[PREFIX + k] for k in status.fields if PREFIX + k in tags})
        return status

    def reached(self) -> tuple[int, float]:
        """(step, weight %) the canary had reached (0, 0 before traffic)."""
        return int(self.fields.get("step") or 0), float(self.fields.get("weight") or 0)

    def tags(self, fields: dict[str, str] | None = None) -> dict[str, str]:
        """`fields` (default: the whole status) as run tags (canary.<field>) with a fresh heartbeat: what set() and
        beat() write, and the first tags of a run created live (phase and heartbeat in its first write)."""
        fields = self.fields if fields is None else fields
        return {PREFIX + k: v[:500] for k, v in fields.items()} | {PREFIX + "heartbeat": f"{time.time():.1f}"}

    def set(self, phase: Phase | None = None, **fields) -> None:
        """Change the phase and/or fields (step, weight, failed_checks, resumed, ...) and write them."""
        if phase is not None:
            self.fields["phase"] = phase.value
        self.fields.update({k: f"{v:g}" if isinstance(v, float) else str(v) for k, v in fields.items()})
        self._write(self.fields)

    def beat(self) -> None:
        self._write({})

    def _write(self, fields: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in self.tags(fields).items()])


def _heartbeat(tags: dict) -> float:
    try:
        return float(tags.get(PREFIX + "heartbeat", "0"))
    except ValueError:
        return 0.0


def _model_runs(mlflow_client, model_name: str) -> list:
    exp = mlflow_client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        return []
    return mlflow_client.search_runs([exp.experiment_id], filter_string=f"tags.model = '{model_name}'")


def live_run(mlflow_client, model_name: str, stale_after_s: float):
    """The MLflow run of `model_name`'s canary that is initializing or progressing with a heartbeat
    younger than stale_after_s (its controller is alive), or None."""
    now = time.time()
    for run in _model_runs(mlflow_client, model_name):
        t = run.data.tags
        if t.get(PREFIX + "phase") in LIVE and now - _heartbeat(t) < stale_after_s:
            return run
    return None


def reap_stale(
    mlflow_client,
    model_name: str,
    stale_after_s: float,
    by: str,
    log: Callable[[str], None] = print,
    set_weight: Callable[[float], None] | None = None,
) -> list[str]:
    """Record as aborted every canary run of `model_name` still initializing, progressing or promoting with a
    heartbeat older than stale_after_s; clear `candidate` if it points at such a run's version
    (and set the weight 0 through `set_weight`, when given). Returns the run ids."""
    now, reaped = time.time(), []
    for run in _model_runs(mlflow_client, model_name):
        t = run.data.tags
        if t.get(PREFIX + "phase") not in REAPED:
            continue
        beat = _heartbeat(t)
        if now - beat < stale_after_s:
            continue
        run_id, version = run.info.run_id, t.get("candidate_version")
        since = datetime.fromtimestamp(beat, UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if beat else "its start"
        reason = f"controller gone since {since} ({t.get(PREFIX + 'controller', 'unknown')})"
        if t.get(PREFIX + "phase") == Phase.PROMOTING.value:  # died mid-promotion: it may or may not have happened
            reason += f"; it was promoting v{version}: check production with `quantgate status {model_name}`"
        status = Status.of(mlflow_client, run_id, t)  # its step and controller kept: the reaper is not the controller
        status.set(Phase.ABORTED, aborted=reason, weight=0.0)
        mlflow_client.set_tag(run_id, "outcome", "aborted")
        mlflow_client.set_tag(run_id, "outcome.reason", reason)
        mlflow_client.log_metric(run_id, "stopped_at_step", status.reached()[0])
        mlflow_client.set_terminated(run_id, status="KILLED")
        cleared = ""
        if version and aliases.current(mlflow_client, model_name).get(aliases.CANDIDATE) == version:
            if set_weight is not None:
                set_weight(0.0)
            aliases.clear_candidate(mlflow_client, model_name, by, f"canary run {run_id}: {reason}", run_id)
            cleared = (", weight 0" if set_weight is not None else "") + f", candidate v{version} cleared"
        log(f"canary: run {run_id} (v{version}) recorded as aborted: {reason}{cleared}")
        reaped.append(run_id)
    return reaped
