"""A canary's run and aliases when it is raced, interrupted or cannot clear `candidate` (canary/controller.py
_open_run, _recorded, _finish), on the sqlite registry of tests/test_canary_render.py: no servers."""

import threading
import time

import pytest
from click.testing import CliRunner

import canary.controller as controller
from canary.controller import Interrupted, Outcome, _open_run, _recorded
from canary.policy import CanaryPolicy
from canary.status import Phase
from cli.main import cli
from quantgate.errors import QuantgateError
from registry import aliases, lock
from tests.test_canary_render import MODEL, project, sqlite_registry  # noqa: F401 (fixtures)

BUILDS = ("1", None, "1")  # preflight's (stable, production, fallback) with no production


def opened(client, version: str = "2"):
    return _open_run(client, MODEL, version, BUILDS, CanaryPolicy(), "tester", lambda line: None)


def ended(client, spec, status) -> None:
    """Leave no live run for the next test."""
    with _recorded(spec, status):
        pass


def test_two_canaries_started_at_once_one_runs(project):  # noqa: F811
    """The live-run check and the run's creation were apart: two `canary run` at the same instant both ran."""
    client = project
    results, go = [], threading.Barrier(2)

    def start(version: str) -> None:
        go.wait()
        try:
            results.append(opened(client, version))
        except QuantgateError as exc:
            results.append(exc)

    threads = [threading.Thread(target=start, args=(v,)) for v in ("2", "3")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    runs = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, QuantgateError)]
    assert len(runs) == 1 and len(refused) == 1, results
    assert f"a canary of {MODEL} is in progress: v{runs[0][0].version}, run {runs[0][0].run_id}" in str(refused[0])
    tags = client.get_run(runs[0][0].run_id).data.tags
    assert tags["canary.phase"] == "initializing" and float(tags["canary.heartbeat"]) > 0  # born live
    assert lock.holder_of(client, MODEL) is None
    ended(client, *runs[0])


def test_ctrl_c_mid_step_says_where_and_what_changed(project):  # noqa: F811
    """It said "`candidate` not set, other aliases unchanged" after setting and clearing it, and recorded step 0."""
    client = project
    spec, status = opened(client)
    with pytest.raises(Interrupted) as exc, _recorded(spec, status) as run:
        run.candidate_set = True
        aliases.set_candidate(client, MODEL, "2", "tester", "canary", canary_run_id=spec.run_id, verify=False)
        status.set(Phase.PROGRESSING, step=1, weight=5.0)
        raise KeyboardInterrupt
    o = exc.value.outcome
    assert (o.decision, o.step, o.percent, o.changes) == ("aborted", 1, 5.0, ("candidate: v2 -> none",))
    run = client.get_run(spec.run_id)
    assert run.info.status == "KILLED" and run.data.metrics["stopped_at_step"] == 1
    assert run.data.tags["canary.phase"] == "aborted" and run.data.tags["canary.step"] == "1"
    assert "candidate" not in aliases.current(client, MODEL)


def test_a_candidate_that_cannot_be_cleared_still_ends_the_run(project, monkeypatch):  # noqa: F811
    """clear_candidate failing on a held lock left the run RUNNING and initializing: the next canary was refused."""
    client = project
    spec, status = opened(client)

    def busy(*args, **kwargs):
        raise lock.LockBusy(f"{MODEL}: another alias/approval change holds the registry lock")

    monkeypatch.setattr(controller.aliases, "clear_candidate", busy)
    with pytest.raises(QuantgateError, match="the gateway went away"), _recorded(spec, status) as run:
        run.candidate_set = True
        raise QuantgateError("the gateway went away")
    run = client.get_run(spec.run_id)
    assert run.info.status == "FAILED" and run.data.tags["canary.phase"] == "aborted"
    assert run.data.tags["outcome.reason"] == (
        "the gateway went away; `candidate` still points at v2: clearing it failed "
        f"({MODEL}: another alias/approval change holds the registry lock); the next canary moves it"
    )
    monkeypatch.undo()
    ended(client, *opened(client, "3"))  # not refused as "in progress"


def test_ctrl_c_while_the_run_opens_records_it_as_aborted(project, monkeypatch):  # noqa: F811
    """An interrupt after the run existed left it RUNNING with no phase, which no later canary reaped."""
    client = project

    def interrupted(spec, log):
        raise KeyboardInterrupt

    monkeypatch.setattr(controller, "_describe_run", interrupted)
    with pytest.raises(Interrupted) as exc:
        opened(client)
    run = client.get_run(exc.value.outcome.run_id)
    assert run.info.status == "KILLED" and run.data.tags["canary.phase"] == "aborted"
    assert run.data.tags["outcome.reason"] == "interrupted (Ctrl-C or SIGTERM)"


def test_the_interrupt_message_says_the_run_the_step_and_the_aliases(project, monkeypatch, tmp_path):  # noqa: F811
    def interrupted_at_step_2(*args, **kwargs):
        raise Interrupted(
            Outcome("aborted", 2, 25.0, "interrupted (Ctrl-C or SIGTERM)", "abc123", ("candidate: v2 -> none",))
        )

    monkeypatch.setattr(controller, "run_canary_on_gateway", interrupted_at_step_2)
    monkeypatch.setattr("registry.store.client", lambda existing=False: None)
    (tmp_path / "token").write_text("t" * 32 + "\n")
    result = CliRunner().invoke(
        cli,
        [
            "canary",
            "run",
            MODEL,
            "2",
            "--by",
            "t",
            "--gateway",
            "http://127.0.0.1:9",
            "--token-file",
            str(tmp_path / "token"),
        ],
    )
    assert result.exit_code == 1 and result.output.strip().splitlines() == [
        f"Error: canary run abc123 of {MODEL} v2 interrupted at step 2 (25%): aborted (interrupted (Ctrl-C or "
        "SIGTERM)); aliases: candidate: v2 -> none"
    ], result.output


def test_ctrl_c_asks_the_canary_to_stop_and_a_second_one_interrupts():
    """A Ctrl-C raised anywhere once cut a registry write mid-promotion (sqlite locked, the lock held, the run left
    `promoting`) and once was swallowed in a weakref callback while the canary went on to promote: the first Ctrl-C
    now sets `stop`, which the controller reads at its next wait, as SIGTERM does."""
    import os
    import signal

    from canary.commands import operator_stops

    stop = threading.Event()
    before = signal.getsignal(signal.SIGINT)
    restore = operator_stops(stop)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.wait(5)  # asked, not raised
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            stop.wait(5)  # the handler runs here at the latest
    finally:
        restore()
    assert signal.getsignal(signal.SIGINT) is before


def test_an_interrupt_after_the_promotion_is_recorded_as_the_promotion(project):  # noqa: F811
    """A second Ctrl-C while the canary stopped its load, after promote() returned, was recorded as "aborted, no
    alias changed" with v2 in production."""
    client = project
    spec, status = opened(client)
    with pytest.raises(Interrupted) as exc, _recorded(spec, status):
        status.set(Phase.PROMOTING, step=2, weight=100.0)
        status.fields["phase"] = Phase.PROMOTED.value  # as _walk marks it once aliases.promote returned
        raise KeyboardInterrupt
    assert (exc.value.outcome.decision, exc.value.outcome.step) == ("promoted", 2)
    run = client.get_run(spec.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["canary.phase"] == "promoted"
    assert run.data.tags["outcome"] == "promoted"


def test_a_stop_while_the_promotion_waits_for_the_registry_lock_changes_nothing(project):  # noqa: F811
    """A stop set while promote() waited for a lock held elsewhere was not heeded: it promoted once the lock freed."""
    client = project
    other = lock.acquire(client, MODEL, "rollback to v1 by bob")
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    started = time.monotonic()
    try:
        with pytest.raises(lock.LockWaitStopped, match="stopped while waiting for the registry lock held by rollback"):
            aliases.promote(client, MODEL, "2", None, "tester", "go", verify=False, stop=stop)
    finally:
        other.release()
    assert time.monotonic() - started < lock.WAIT_S / 3  # not the whole wait
    assert aliases.current(client, MODEL) == {"fallback": "1"} and lock.holder_of(client, MODEL) is None
    with pytest.raises(lock.LockWaitStopped, match="stopped before promoting v2"):  # asked before the lock
        aliases.promote(client, MODEL, "2", None, "tester", "go", verify=False, stop=stop)


def test_the_canary_whose_promotion_is_stopped_aborts_as_stopped(project, monkeypatch):  # noqa: F811
    """Every step passed, then Ctrl-C while promote() waited: the canary's outcome is the operator's abort."""
    client = project
    spec, status = opened(client)
    hooks, drained = controller.Hooks(log=lambda line: None), []

    class Split:
        def drain(self):
            drained.append(True)

    real_promote = controller.aliases.promote

    def stopped_inside(*args, **kwargs):  # the stop lands inside promote(), after _walk's own last check
        kwargs["stop"].set()
        return real_promote(*args, **{**kwargs, "verify": False})

    monkeypatch.setattr(controller, "_run_steps", lambda split, spec, steps, *rest: len(steps))
    monkeypatch.setattr(controller.aliases, "promote", stopped_inside)
    outcome = controller._walk(spec, Split(), spec.policy.steps, hooks, status, None)
    assert (outcome.decision, outcome.reason, outcome.step) == ("aborted", controller.STOPPED, len(spec.policy.steps))
    assert drained == [True] and aliases.current(client, MODEL) == {"fallback": "1"}
    ended(client, spec, status)
