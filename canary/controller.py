"""One canary, from the registry check to promote or abort (`quantgate canary run MODEL VERSION`).

1. Refuse unless VERSION is approved (gate PASS, or an override recorded: registry/approval.py),
   is not already stable, and a `fallback` exists. Stable = `production`, else `fallback`.
2. Serve stable, the fp16 `fallback` (the shadow; shared when it is stable) and the candidate
   from their verified registry artifacts (canary/fleet.py); point alias `candidate` at VERSION.
3. Plan (canary/plan.py) from the traffic: given (`--load-rps`), or measured over measure_s at
   0 % once the router runs; say how long the canary will take, and refuse (QuantgateError)
   a plan whose steps cannot reach min_samples within max_step_s.
4. Route through canary/router.py; for each policy step set the weight, look at the step's
   samples every check_interval_s (canary/analysis.py, one live line per check), and end the
   step at the first look after min_step_s where every check PASSes (each needs min_samples,
   which takes the planned seconds). At 100 % stable gets no traffic: its latencies from the
   earlier steps are the reference. Abort on a FAIL (each check's test holds its level over
   every look), a candidate server that exits, an INCONCLUSIVE step at its planned end under
   `inconclusive: abort` or at max_step_s, or Ctrl-C (`step_decision`).
5. Promote (registry/aliases.promote: production -> VERSION, old production -> previous,
   compare-and-set against the production seen in step 1) or abort (weight 0, `candidate`
   cleared, other aliases unchanged). Both are audit runs that name this canary's MLflow run
   (experiment `quantgate-canary`), which holds the policy and every step's metrics.
Every server started here is stopped on every exit path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from canary.analysis import analyze, live_line
from canary.fleet import ServingFleet
from canary.plan import StepPlan, Traffic, measured_traffic, plan_line, require_feasible
from canary.policy import CanaryPolicy
from canary.router import Router
from canary.server import RouterServer
from quantgate.errors import QuantgateError
from quantgate.serving import ServeParams
from quantgate.stats import Verdict
from registry import aliases, approval, store, tags, versions

EXPERIMENT = "quantgate-canary"


@dataclass(frozen=True)
class Outcome:
    """How a canary ended: decision "promoted" or "aborted" at `step` (1-based; 0 = before traffic)."""

    decision: str
    step: int
    percent: float
    reason: str
    run_id: str
    changes: tuple[str, ...] = ()


class Aborted(Exception):
    """Internal: stop the step loop with a reason."""


def preflight(mlflow_client, model_name: str, version: str) -> tuple[str, str | None, str]:
    """(stable version, production version or None, fallback version) for a canary of `version`.

    Raises QuantgateError if `version` is missing, not approved, already stable, or there is
    no `fallback` (the 16-bit build, set by `dvc repro`).
    """
    mv = versions.require_version(mlflow_client, model_name, version)
    a = approval.read_approval(mv.tags, versions.recorded_verdict(mlflow_client, mv))
    if not a.approved:
        override = (
            ""
            if mv.tags.get(tags.VERDICT) in tags.PASSING
            else f" --override REASON ({tags.VERDICT}={mv.tags.get(tags.VERDICT)})"
        )
        raise QuantgateError(
            f"{model_name} v{version}: {a.why}; a release manager approves with "
            f"`quantgate approve {model_name} {version} --reason ...{override}`"
        )
    now = aliases.current(mlflow_client, model_name)
    fallback, production = now.get(aliases.FALLBACK), now.get(aliases.PRODUCTION)
    if fallback is None:
        raise QuantgateError(f"{model_name} has no `fallback` alias (the 16-bit build); run `dvc repro` first")
    stable = production or fallback
    if stable == version:
        raise QuantgateError(
            f"{model_name} v{version} already is the stable build "
            f"({'production' if production else 'fallback'}); nothing to canary"
        )
    return stable, production, fallback


def _step_metrics(result, router: Router, t0: float, percent: float) -> dict[str, float]:
    samples = router.samples_since(t0)
    out = {
        "weight_pct": percent,
        "n_candidate": sum(s.role == "candidate" for s in samples),
        "n_stable": sum(s.role == "stable" for s in samples),
        "verdict": {Verdict.PASS: 1.0, Verdict.INCONCLUSIVE: 0.0, Verdict.FAIL: -1.0}[result.verdict],
    }
    out.update({c.name: c.value for c in result.checks if c.value is not None and c.value != float("inf")})
    return out


def step_samples(router: Router, t0: float, run_t0: float, min_samples: int) -> list:
    """The samples of the step that began at `t0`; when it has fewer than `min_samples` stable
    streaming answers (at 100 % stable gets no traffic), stable's samples from the earlier
    steps of this run are added as the latency reference."""
    samples = router.samples_since(t0)
    if sum(s.role == "stable" and s.ttft_s is not None for s in samples) < min_samples:
        samples += [s for s in router.samples_since(run_t0) if s.role == "stable" and s.t < t0]
    return samples


def step_decision(verdict: Verdict, elapsed_s: float, step: StepPlan, policy: CanaryPolicy) -> str:
    """What a look at a step decides: "fail" (abort), "pass" (next step), "end" (abort:
    INCONCLUSIVE at the step's end) or "hold" (look again); pure."""
    if verdict is Verdict.FAIL:
        return "fail"
    if elapsed_s >= policy.min_step_s and verdict is Verdict.PASS:
        return "pass"
    if elapsed_s >= policy.max_step_s or (policy.inconclusive == "abort" and elapsed_s >= step.end_s):
        return "end"
    return "hold"


def _run_steps(
    router: Router,
    fleet: ServingFleet,
    policy: CanaryPolicy,
    steps: tuple[StepPlan, ...],
    version: str,
    log,
    stop: threading.Event,
    record: Callable[[int, dict], None],
) -> int:
    """Walk the planned steps; return the number of steps passed. Raises Aborted(reason, step, percent)."""
    run_t0 = time.time()
    for step in steps:
        i, percent = step.step, step.percent
        router.set_weight(percent)
        t0 = time.time()
        log(f"canary: step {i}/{len(steps)}: {percent:g}% of traffic to v{version} (planned {step.seconds:.0f} s)")
        while True:
            if stop.wait(policy.check_interval_s):
                raise Aborted("stopped by the operator (Ctrl-C)", i, percent)
            if not fleet.alive(version):
                raise Aborted(f"the candidate's vLLM server (v{version}) exited", i, percent)
            result = analyze(step_samples(router, t0, run_t0, policy.min_samples), router.shadows_since(t0), policy)
            for check in result.checks:
                log(live_line(i, percent, check))
            elapsed = time.time() - t0
            n_cand = sum(s.role == "candidate" for s in router.samples_since(t0))
            decision = step_decision(result.verdict, elapsed, step, policy)
            if decision != "hold":
                record(i, _step_metrics(result, router, t0, percent))
            if decision == "fail":
                failed = "; ".join(c.text for c in result.checks if c.verdict is Verdict.FAIL)
                raise Aborted(f"step {i} FAILed after {elapsed:.0f} s: {failed}", i, percent)
            if decision == "pass":
                log(f"canary: step {i} PASS after {elapsed:.0f} s, {n_cand} candidate requests")
                break
            if decision == "end":
                why = "max_step_s" if elapsed >= policy.max_step_s else "its planned end (inconclusive: abort)"
                raise Aborted(
                    f"step {i} still {result.verdict.value} after {elapsed:.0f} s, at {why} "
                    f"({n_cand} candidate requests)",
                    i,
                    percent,
                )
    return len(steps)


def _measure(router: Router, policy: CanaryPolicy, stop: threading.Event, log) -> Traffic:
    """The offered traffic over measure_s at 0 % to the candidate (before step 1)."""
    log(f"canary: measuring traffic for {policy.measure_s:g} s (0% to the candidate)")
    t0 = time.time()
    if stop.wait(policy.measure_s):
        raise Aborted("stopped by the operator (Ctrl-C)", 0, 0.0)
    return measured_traffic(router.samples_since(t0), time.time() - t0)


def run_canary(
    mlflow_client,
    model_name: str,
    version,
    policy: CanaryPolicy,
    serve: ServeParams,
    by: str,
    work_dir: Path,
    *,
    reuse: dict[str, str] | None = None,
    log=print,
    stop: threading.Event | None = None,
    on_router: Callable[[str], Callable[[], None] | None] | None = None,
    traffic: Traffic | None = None,
) -> Outcome:
    """Run one canary of `version` of `model_name` (see the module docstring).

    `reuse` maps versions to URLs of servers already running (not verified, not stopped);
    `on_router(url)` is called once the router answers (e.g. to start load) and may return a
    callable run before the router stops (e.g. to stop that load); setting `stop` aborts
    like Ctrl-C. `traffic` (e.g. the --load-rps rate) plans the steps before anything starts;
    None measures it over measure_s once the router runs. Raises QuantgateError before any
    alias or server changes when the preflight fails or a given traffic cannot finish the plan;
    a measured traffic that cannot is refused the same way after the candidate alias was set
    (and cleared again); every other failure is an abort recorded in the registry.
    """
    version = versions.version_number(version)
    stable, production, fallback = preflight(mlflow_client, model_name, version)
    steps = require_feasible(policy, traffic) if traffic is not None else None
    stop = stop or threading.Event()
    exp_id = store.experiment_id(mlflow_client, EXPERIMENT, mlflow_client.tracking_uri)
    run_id = mlflow_client.create_run(
        exp_id,
        run_name=f"canary-{model_name}-v{version}",
        tags={
            "model": model_name,
            "candidate_version": version,
            "stable_version": stable,
            "fallback_version": fallback,
            "by": by,
        },
    ).info.run_id
    for key, value in policy.model_dump(exclude={"router", "servers"}).items():
        mlflow_client.log_param(run_id, key, str(value))

    def record(step: int, metrics: dict) -> None:
        for key, value in metrics.items():
            mlflow_client.log_metric(run_id, key, float(value), step=step)

    log(f"canary: run {run_id}: v{version} against stable v{stable} (shadow: fallback v{fallback})")
    if steps is not None:
        log(plan_line(policy, traffic, steps))
    outcome, status = None, "FAILED"
    candidate_set = False
    try:
        with ServingFleet(mlflow_client, model_name, serve, policy, Path(work_dir) / run_id) as fleet:
            for v, url in (reuse or {}).items():
                fleet.reuse(versions.version_number(v), url)
            fleet.start(stable, "stable", log)
            fleet.start(fallback, "shadow", log)
            fleet.start(version, "candidate", log)
            aliases.set_candidate(mlflow_client, model_name, version, by, f"canary run {run_id}", canary_run_id=run_id)
            candidate_set = True
            router = Router(fleet.resolver(stable), policy, model_name=model_name)
            with RouterServer(router, policy.router.host, policy.router.port) as server:
                log(f"canary: router at {server.url}/v1 (OpenAI API), metrics at {server.url}/metrics")
                before_stop = on_router(server.url) if on_router else None
                try:
                    if steps is None:
                        traffic = _measure(router, policy, stop, log)
                        steps = require_feasible(policy, traffic)
                        log(plan_line(policy, traffic, steps))
                    step = _run_steps(router, fleet, policy, steps, version, log, stop, record)
                    changes = aliases.promote(
                        mlflow_client,
                        model_name,
                        version,
                        production,
                        by,
                        f"canary run {run_id} passed {step} steps",
                        canary_run_id=run_id,
                    )
                    candidate_set = False
                    outcome = Outcome(
                        "promoted", step, policy.steps[-1], "passed every step", run_id, tuple(map(str, changes))
                    )
                except Aborted as exc:
                    reason, step, percent = exc.args
                    outcome = Outcome("aborted", step, percent, reason, run_id)
                except aliases.AliasConflict as exc:
                    outcome = Outcome("aborted", len(policy.steps), policy.steps[-1], str(exc), run_id)
                finally:
                    router.set_weight(0)
                    if before_stop:
                        before_stop()
        status = "FINISHED"
    except KeyboardInterrupt:
        outcome = Outcome("aborted", 0, 0.0, "interrupted (Ctrl-C)", run_id)
        status = "KILLED"
        raise
    except QuantgateError as exc:
        outcome = Outcome("aborted", 0, 0.0, str(exc), run_id)
        raise
    finally:
        if candidate_set:
            cleared = aliases.clear_candidate(
                mlflow_client,
                model_name,
                by,
                f"canary run {run_id} aborted: {outcome.reason if outcome else 'error'}",
                canary_run_id=run_id,
            )
            if outcome is not None:
                outcome = Outcome(
                    outcome.decision, outcome.step, outcome.percent, outcome.reason, run_id, tuple(map(str, cleared))
                )
        if outcome is not None:
            mlflow_client.set_tag(run_id, "outcome", outcome.decision)
            mlflow_client.set_tag(run_id, "outcome.reason", outcome.reason[:500])
            mlflow_client.log_metric(run_id, "stopped_at_step", outcome.step)
        mlflow_client.set_terminated(run_id, status=status)
    log(f"canary: {outcome.decision} at step {outcome.step} ({outcome.percent:g}%): {outcome.reason}")
    for change in outcome.changes:
        log(f"canary: alias {change}")
    return outcome
