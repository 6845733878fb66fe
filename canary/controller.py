"""One canary, from the registry check to promote or abort (`quantgate canary run MODEL VERSION`).

1. Refuse unless VERSION is approved (gate PASS, or an override recorded: registry/approval.py),
   is not already stable, and a `fallback` exists. Stable = `production`, else `fallback`.
2. Serve stable, the fp16 `fallback` (the shadow; shared when it is stable) and the candidate
   from their verified registry artifacts (canary/local.py); point alias `candidate` at VERSION.
3. Plan (canary/plan.py) from the traffic: given (`--load-rps`), or measured over measure_s at
   0 % once the router runs; say how long the canary will take, and refuse (QuantgateError)
   a plan whose steps cannot reach min_samples within max_step_s. Say which latency checks the
   versions' profiles already exceed (canary/forecast.py; a warning, tag canary.forecast).
4. Route through a gateway (gateway/router.py); for each policy step set the weight, look at the step's
   samples and the candidate vLLM server's gauges (canary/engine.py) every check_interval_s
   (canary/analysis.py, one live line per check), and end the
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

There is one way to move traffic: a gateway's admin endpoint (gateway/admin.py, `GatewaySplit`). On a running
gateway (`run_canary_on_gateway`, `canary run --gateway`) step 2 is the gateway's: setting `candidate` makes it
warm the version. Without one (`run_canary`) the canary starts its servers (step 2) and a gateway of its own in
this process around them (gateway/inprocess.py: its router public, its admin endpoint on loopback with a fresh
token); from the `candidate` alias on, both runs are the same code (`_candidate_steps`). Either way the run's
status (phase, step, weight, failed checks, controller, heartbeat) is persisted as tags on its MLflow run
(canary/status.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from canary.analysis import analyze, live_line
from canary.engine import EngineSample, scrape
from canary.forecast import latency_forecast
from canary.local import LocalServers
from canary.plan import StepPlan, Traffic, measured_traffic, plan_line, require_feasible
from canary.policy import CHECK_KINDS, GAUGES, CanaryPolicy, CanaryTopology
from canary.status import EXPERIMENT, Phase, Status, live_run, reap_stale
from canary.traffic import TrafficSplit
from gateway.admin import GatewayUnreachable, RemoteRouter
from gateway.fleet import reused_backend
from gateway.inprocess import local_gateway
from gateway.router import Router, RouterParams
from quantgate.errors import QuantgateError
from quantgate.serving import ServeParams, serving_versions
from quantgate.stats import Verdict
from registry import aliases, approval, lock, store, tags, versions


@dataclass(frozen=True)
class Outcome:
    """How a canary ended: decision "promoted" or "aborted" at `step` (1-based; 0 = before traffic)."""

    decision: str
    step: int
    percent: float
    reason: str
    run_id: str
    changes: tuple[str, ...] = ()


STOPPED = "stopped by the operator (Ctrl-C or SIGTERM)"  # Hooks.stop set: the abort's reason


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or a SIGTERM that interrupts) during a canary, raised once its run is recorded as aborted:
    `outcome` says at which step, and which aliases changed on the way out."""

    def __init__(self, outcome: Outcome):
        super().__init__(outcome.reason)
        self.outcome = outcome


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


def _step_metrics(result, router, t0: float, percent: float) -> dict[str, float]:
    samples = router.samples_since(t0)
    out = {
        "weight_pct": percent,
        "n_candidate": sum(s.role == "candidate" for s in samples),
        "n_stable": sum(s.role == "stable" for s in samples),
        "verdict": {Verdict.PASS: 1.0, Verdict.INCONCLUSIVE: 0.0, Verdict.FAIL: -1.0}[result.verdict],
    }
    out.update({c.name: c.value for c in result.checks if c.value is not None and c.value != float("inf")})
    return out


def _step_evidence(result, samples: list, shadows: list) -> dict:
    """What a step was judged on, for its run's artifact canary/step-N.json: the check lines, every
    backend attempt the checks saw (latency in seconds) and the shadow comparisons, so a release
    manager can re-judge a PASS or an abort offline."""
    return {
        "verdict": result.verdict.value,
        "checks": [c.text for c in result.checks],
        "samples": [dataclasses.asdict(s) for s in samples],
        "shadows": [dataclasses.asdict(s) for s in shadows],
    }


def step_samples(router, t0: float, run_t0: float, min_samples: int) -> list:
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


class Split(TrafficSplit, Protocol):
    """What the step loop drives: the traffic split (canary/traffic.py) of a gateway, and what a live rollout
    also asks of it: is the candidate's server alive, did the gateway restart, its vLLM gauges. `GatewaySplit`
    implements it over any gateway's admin endpoint: a standing `quantgate serve` or the canary's own
    in-process one (gateway/inprocess.py)."""

    def alive(self, version: str) -> bool: ...
    def recover(self, percent: float) -> str | None: ...
    def engine(self, version: str) -> EngineSample | None: ...

    @property
    def shadow_fraction(self) -> float: ...

    @property
    def shadow_teams(self) -> int: ...


class GatewaySplit(RemoteRouter):
    """A running gateway's split (gateway.admin.RemoteRouter) that notices a restart.

    `recover(percent)` at each look: None while the gateway is the one seen at the start
    (same pid and start time) at `percent`; else (it restarted: weight back to 0, or it does
    not answer) it waits up to `lost_s` for the gateway to answer with `version` warm, sets
    `percent` again and returns why; raises GatewayUnreachable if it does not come back in time.
    """

    def __init__(self, url: str, token: str, version: str, lost_s: float, beat: Callable[[], None] = lambda: None):
        super().__init__(url, token)
        self.version, self.lost_s, self.beat = version, lost_s, beat
        self.seen: tuple | None = None  # (pid, started_at) of the gateway the canary runs on
        self.shadow_fraction = 0.5  # the gateway's (fleet.router.shadow_fraction), as its state reports it
        self.shadow_teams = 1  # the teams its shadow samples can name (Router.shadow_teams); 1 from an older one

    def _identity(self, s: dict) -> tuple:
        return s.get("pid"), s.get("started_at")

    def weight_or_nothing(self, percent: float) -> None:
        """Set the weight if the gateway takes it (a canary left by a dead controller is set back to 0 %)."""
        with contextlib.suppress(QuantgateError):
            self.set_weight(percent)

    def attach(self, state: dict) -> None:
        self.seen = self._identity(state)
        self.shadow_fraction = float(state.get("shadow_fraction", self.shadow_fraction))
        self.shadow_teams = int(state.get("shadow_teams", self.shadow_teams))

    def engine(self, version: str) -> EngineSample | None:
        url = self.state()["fleet"].get(version, {}).get("url")  # the gateway's vLLM server, as it reports it
        return scrape(url, f"v{version}") if url else None

    def recover(self, percent: float) -> str | None:
        try:
            s = self.state()
            if self._identity(s) == self.seen and s["weight"] == percent:
                return None
            why = (
                f"the gateway restarted (weight {s['weight']:g}%, not {percent:g}%)"
                if self._identity(s) != self.seen
                else f"the gateway's weight was {s['weight']:g}%, not {percent:g}%"
            )
        except GatewayUnreachable as exc:
            why = f"the gateway stopped answering ({exc})"
        try:
            s = self.wait_warm(self.version, self.lost_s, beat=self.beat)
        except GatewayUnreachable as exc:
            raise GatewayUnreachable(f"{why}; not back within gateway_lost_s={self.lost_s:g} s: {exc}") from None
        self.attach(s)
        self.set_weight(percent)
        return why


def _run_steps(split: Split, spec: Spec, steps: tuple[StepPlan, ...], hooks: Hooks, record, status: Status) -> int:
    """Walk the planned steps; return the number of steps passed. Raises Aborted(reason, step, percent).
    `record(step, metrics, evidence)` keeps a step's outcome on the canary's run."""
    look = _Look(split, spec, hooks, record, status)
    for step in steps:
        try:
            split.set_weight(step.percent)
        except GatewayUnreachable:
            pass  # the first look's recover() waits for the gateway and sets it
        status.set(Phase.PROGRESSING, step=step.step, weight=step.percent)
        hooks.log(
            f"canary: step {step.step}/{len(steps)}: {step.percent:g}% of traffic to v{spec.version} "
            f"(planned {step.seconds:.0f} s)"
        )
        look.step_over(step)
    return len(steps)


@dataclass
class _Look:
    """The looks at one canary's steps, every check_interval_s until a step PASSes or the canary aborts:
    `t0` the step's start, `run_t0` the run's (both reset when the gateway came back), `engine` the
    candidate's vLLM gauges scraped in this step."""

    split: Split
    spec: Spec
    hooks: Hooks
    record: Callable[[int, dict, dict], None]
    status: Status
    run_t0: float = field(default_factory=time.time)

    def step_over(self, step: StepPlan) -> None:
        """Look at `step` until it PASSes (return) or aborts (Aborted)."""
        policy, i, percent = self.spec.policy, step.step, step.percent
        self.t0, self.engine = time.time(), []
        while True:
            if self.hooks.stop.wait(policy.check_interval_s):
                raise Aborted(STOPPED, i, percent)
            try:
                resumed = self.split.recover(percent)
            except QuantgateError as exc:
                raise Aborted(str(exc), i, percent) from None
            if resumed is not None:  # the gateway came back: this step starts over at its weight
                self.hooks.log(f"canary: step {i} resumed at {percent:g}%: {resumed}")
                self.status.set(resumed=f"step {i}: {resumed}")
                self.t0 = self.run_t0 = time.time()  # the new gateway's samples only
                self.engine = []
                continue
            try:
                result, decision, elapsed, n_cand = self._judge(step)
            except GatewayUnreachable:
                continue  # gone between two calls: the next look's recover() waits for it
            if self._decided(step, result, decision, elapsed, n_cand):
                return

    def _judge(self, step: StepPlan) -> tuple:
        """One look: (analysis result, step_decision, seconds into the step, candidate requests); a decided
        step is recorded. Raises Aborted when the candidate's server exited."""
        split, policy, version = self.split, self.spec.policy, self.spec.version
        if not split.alive(version):
            raise Aborted(f"the candidate's vLLM server (v{version}) exited", step.step, step.percent)
        self.status.beat()
        scraped = split.engine(version) if any(policy.check(n) for n in GAUGES) else None
        self.engine += [scraped] if scraped else []
        samples, shadows = step_samples(split, self.t0, self.run_t0, policy.min_samples), split.shadows_since(self.t0)
        result = analyze(samples, shadows, policy, self.engine, teams=split.shadow_teams)
        n_cand = sum(s.role == "candidate" for s in split.samples_since(self.t0))
        elapsed = time.time() - self.t0
        decision = step_decision(result.verdict, elapsed, step, policy)
        if decision != "hold":
            metrics = _step_metrics(result, split, self.t0, step.percent)
            self.record(step.step, metrics, _step_evidence(result, samples, shadows))
        return result, decision, elapsed, n_cand

    def _decided(self, step: StepPlan, result, decision: str, elapsed: float, n_cand: int) -> bool:
        """Say the look's check lines; True when the step PASSed; raises Aborted on a FAIL or its end."""
        i, percent, policy = step.step, step.percent, self.spec.policy
        for check in result.checks:
            self.hooks.log(live_line(i, percent, check))
        if decision == "fail":
            failed = [c for c in result.checks if c.verdict is Verdict.FAIL]
            self.status.set(failed_checks=",".join(c.name for c in failed))
            raise Aborted(f"step {i} FAILed after {elapsed:.0f} s: {'; '.join(c.text for c in failed)}", i, percent)
        if decision == "pass":
            self.hooks.log(f"canary: step {i} PASS after {elapsed:.0f} s, {n_cand} candidate requests")
            return True
        if decision == "end":
            why = "max_step_s" if elapsed >= policy.max_step_s else "its planned end (inconclusive: abort)"
            raise Aborted(
                f"step {i} still {result.verdict.value} after {elapsed:.0f} s, at {why} ({n_cand} candidate requests)",
                i,
                percent,
            )
        return False


def _measure(split: Split, policy: CanaryPolicy, hooks: Hooks) -> Traffic:
    """The offered traffic over measure_s at 0 % to the candidate (before step 1)."""
    hooks.log(f"canary: measuring traffic for {policy.measure_s:g} s (0% to the candidate)")
    t0 = time.time()
    if hooks.stop.wait(policy.measure_s):
        raise Aborted(STOPPED, 0, 0.0)
    return measured_traffic(split.samples_since(t0), time.time() - t0, split.shadow_fraction)


@dataclass(frozen=True)
class Hooks:
    """What a canary run's caller gives it besides the canary: `log` each line; `stop`, set (what `canary run`
    does on Ctrl-C or SIGTERM), aborts at the next wait, recorded as "stopped by the operator (Ctrl-C or SIGTERM)";
    `on_router(url)` is called once traffic can flow (e.g. to start load) and may return a callable run
    before the end (e.g. to stop that load); `traffic` (e.g. the --load-rps rate) plans the steps before
    anything starts, None measures it over measure_s once the router runs."""

    log: Callable[[str], None] = print
    stop: threading.Event = field(default_factory=threading.Event)
    on_router: Callable[[str], Callable[[], None] | None] | None = None
    traffic: Traffic | None = None


@dataclass(frozen=True)
class Local:
    """A canary without a standing gateway: its own vLLM servers (`serve` = evaluate.serve, files under
    `work_dir`) placed by `topology` (params.yaml canary_topology), its own router set by `router_params`
    (fleet.router, the gateway's), and `reuse`: versions -> URLs of servers already running (not verified,
    not stopped)."""

    serve: ServeParams
    work_dir: Path
    topology: CanaryTopology = CanaryTopology()
    router_params: RouterParams = RouterParams()
    reuse: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Admin:
    """A running `quantgate serve`'s admin endpoint: its URL and bearer token."""

    url: str
    token: str


@dataclass(frozen=True)
class Spec:
    """One canary: `version` of `model` against `stable` (production, else fallback) with the fp16
    `fallback` as shadow, under `policy`, run `by` someone; `run_id` is its MLflow run."""

    client: object
    model: str
    version: str
    stable: str
    production: str | None
    fallback: str
    policy: CanaryPolicy
    by: str
    run_id: str = ""


def _open_run(
    mlflow_client, model_name: str, version: str, builds: tuple, policy: CanaryPolicy, by: str, log
) -> tuple[Spec, Status]:
    """The canary's MLflow run, phase initializing; `builds` = preflight()'s (stable, production, fallback).
    Raises QuantgateError while another canary of the model is live (one at a time); an interrupt or error
    after the run exists records it as aborted (Interrupted for Ctrl-C)."""
    stable, production, fallback = builds
    exp_id = store.experiment_id(mlflow_client, EXPERIMENT, mlflow_client.tracking_uri)
    status = Status(mlflow_client, "")
    # the check and the run, born live (phase and heartbeat), under the model's registry lock: two canaries
    # started at once both passed the check before either run existed, and both ran
    with lock.held(mlflow_client, model_name, f"canary of v{version} by {by} starting", by=by):
        other = live_run(mlflow_client, model_name, policy.stale_after_s)
        if other is not None:
            t = other.data.tags
            raise QuantgateError(
                f"a canary of {model_name} is in progress: v{t.get('candidate_version')}, run {other.info.run_id} "
                f"({t.get('canary.phase')}, step {t.get('canary.step')}, controller {t.get('canary.controller')}); "
                "wait for it to promote or abort, or stop it (Ctrl-C in its terminal)"
            )
        own = {"model": model_name, "candidate_version": version, "stable_version": stable, "by": by}
        status.run_id = mlflow_client.create_run(
            exp_id,
            run_name=f"canary-{model_name}-v{version}",
            tags={**own, "fallback_version": fallback, **status.tags()},
        ).info.run_id
    spec = Spec(mlflow_client, model_name, version, stable, production, fallback, policy, by, status.run_id)
    with _recorded(spec, status, ends=False):  # Ctrl-C here: recorded as aborted, not left running without a phase
        _describe_run(spec, log)
    return spec, status


def _describe_run(spec: Spec, log) -> None:
    """The run's params (the policy, one per check), its first log lines and the latency forecast."""
    client, run_id, policy = spec.client, spec.run_id, spec.policy
    for key, value in policy.model_dump(exclude={"checks"}).items():
        client.log_param(run_id, key, str(value))
    for check in policy.checks:  # one param per check, e.g. check.error_rate = "max 0.01"
        client.log_param(run_id, f"check.{check.name}", f"{CHECK_KINDS[check.name][0]} {check.bound:g}")
    log(f"canary: run {run_id}: v{spec.version} against stable v{spec.stable} (shadow: fallback v{spec.fallback})")
    log(f"canary: checks {', '.join(map(str, policy.checks))} at steps {', '.join(f'{p:g}%' for p in policy.steps)}")
    forecast = latency_forecast(
        policy,
        (spec.stable, client.get_model_version(spec.model, spec.stable).tags),
        (spec.version, client.get_model_version(spec.model, spec.version).tags),
    )
    for line in forecast:
        log(f"canary: forecast: {line}")
    if forecast:
        client.set_tag(run_id, "canary.forecast", " | ".join(forecast)[:5000])


def _walk(spec: Spec, split: Split, steps, hooks: Hooks, status: Status, url: str | None) -> Outcome:
    """Plan (from hooks.traffic, else measured), walk the steps, promote; an abort is an Outcome too.
    `hooks.on_router(url)` is called first (its callable, if any, last). The split is drained (0 %)
    on every exit. Raises QuantgateError for a plan that cannot finish."""
    client, policy, run_id, log = spec.client, spec.policy, spec.run_id, hooks.log
    before_stop = hooks.on_router(url) if hooks.on_router and url else None

    def record(step: int, metrics: dict, evidence: dict) -> None:
        for key, value in metrics.items():
            client.log_metric(run_id, key, float(value), step=step)
        client.log_dict(run_id, evidence, f"canary/step-{step}.json")

    try:
        if steps is None:
            traffic = _measure(split, policy, hooks)
            steps = require_feasible(policy, traffic)
            log(plan_line(policy, traffic, steps))
        step = _run_steps(split, spec, steps, hooks, record, status)
        if hooks.stop.is_set():  # asked during the last look: the operator's word comes before the promotion
            raise Aborted(STOPPED, step, policy.steps[-1])
        status.set(Phase.PROMOTING)
        changes = aliases.promote(
            client,
            spec.model,
            spec.version,
            spec.production,
            spec.by,
            f"canary run {run_id} passed {step} steps",
            canary_run_id=run_id,
            stop=hooks.stop,
        )
        status.fields["phase"] = Phase.PROMOTED.value  # done: an interrupt from here on cannot make it an abort
        return Outcome("promoted", step, policy.steps[-1], "passed every step", run_id, tuple(map(str, changes)))
    except Aborted as exc:
        reason, step, percent = exc.args
        return Outcome("aborted", step, percent, reason, run_id)
    except lock.LockWaitStopped:  # Ctrl-C while the promotion verified the weights or waited for the lock
        return Outcome("aborted", len(policy.steps), policy.steps[-1], STOPPED, run_id)
    except QuantgateError as exc:  # AliasConflict, or the registry lock held past its wait: the canary did not promote
        return Outcome(
            "aborted", len(policy.steps), policy.steps[-1], f"passed every step; promote failed: {exc}", run_id
        )
    finally:
        try:
            split.drain()
        except QuantgateError as exc:  # unreachable, or restarted with another token: it starts at 0 %
            log(f"canary: could not set the gateway's weight to 0: {exc}")
        if before_stop:
            before_stop()


class _Ledger:
    """How a canary run is ending, for _recorded: its outcome, and whether it set `candidate`."""

    outcome: Outcome | None = None
    candidate_set: bool = False


@contextlib.contextmanager
def _recorded(spec: Spec, status: Status, ends: bool = True) -> Iterator[_Ledger]:
    """Record the canary's end (`_finish`): an error is an abort at the step it reached, re-raised; Ctrl-C is one
    too, raised as Interrupted with the outcome; a normal exit ends the run only when `ends` (False while the
    run is being opened)."""
    ledger = _Ledger()
    try:
        yield ledger
    except KeyboardInterrupt:
        if status.fields.get("phase") == Phase.PROMOTED.value:  # interrupted after the promotion, while stopping
            outcome = Outcome("promoted", *status.reached(), "passed every step, then interrupted", spec.run_id)
            ledger.outcome = _finish(spec, status, outcome, "FINISHED", ledger.candidate_set)
        else:
            outcome = Outcome("aborted", *status.reached(), "interrupted (Ctrl-C or SIGTERM)", spec.run_id)
            ledger.outcome = _finish(spec, status, outcome, "KILLED", ledger.candidate_set)
        raise Interrupted(ledger.outcome) from None
    except BaseException as exc:
        outcome = (
            Outcome("aborted", *status.reached(), str(exc), spec.run_id) if isinstance(exc, QuantgateError) else None
        )
        ledger.outcome = _finish(spec, status, outcome, "FAILED", ledger.candidate_set)
        raise
    if ends:
        ledger.outcome = _finish(spec, status, ledger.outcome, "FINISHED", ledger.candidate_set)


def _finish(spec: Spec, status: Status, outcome: Outcome | None, run_status: str, candidate_set: bool) -> Outcome:
    """Clear `candidate` if this canary set it and did not promote; record the outcome, phase and end of the run.
    A `candidate` that cannot be cleared (the registry lock held elsewhere) is said in the outcome's reason,
    and the run is still ended: once it stayed RUNNING and initializing, refusing the next canary."""
    client, run_id = spec.client, spec.run_id
    if candidate_set and not (outcome and outcome.decision == "promoted"):
        why = f"canary run {run_id} aborted: {outcome.reason if outcome else 'error'}"
        try:
            cleared = tuple(map(str, aliases.clear_candidate(client, spec.model, spec.by, why, canary_run_id=run_id)))
        except QuantgateError as exc:
            cleared = ()
            left = (
                f"; `candidate` still points at v{spec.version}: clearing it failed ({exc}); the next canary moves it"
            )
            outcome = dataclasses.replace(outcome, reason=outcome.reason + left) if outcome else outcome
        if outcome is not None:
            outcome = dataclasses.replace(outcome, changes=cleared)
    if outcome is not None:
        client.set_tag(run_id, "outcome", outcome.decision)
        client.set_tag(run_id, "outcome.reason", outcome.reason[:500])
        client.log_metric(run_id, "stopped_at_step", outcome.step)
    promoted = outcome is not None and outcome.decision == "promoted"
    status.set(Phase.PROMOTED if promoted else Phase.ABORTED, weight=0.0)
    client.set_terminated(run_id, status=run_status)
    return outcome


def _report(outcome: Outcome, log) -> Outcome:
    log(f"canary: {outcome.decision} at step {outcome.step} ({outcome.percent:g}%): {outcome.reason}")
    for change in outcome.changes:
        log(f"canary: alias {change}")
    return outcome


def run_canary(
    mlflow_client, model_name: str, version, policy: CanaryPolicy, by: str, local: Local, hooks: Hooks | None = None
) -> Outcome:
    """Run one canary of `version` of `model_name` with its own servers and an in-process gateway around them
    (`local`; see the module docstring and Hooks for `hooks`).

    Raises QuantgateError before any alias or server changes when the preflight fails or a given traffic
    cannot finish the plan; a measured traffic that cannot is refused the same way after the candidate alias
    was set (and cleared again); every other failure is an abort recorded in the registry.
    """
    hooks, where = hooks or Hooks(), local.topology
    version = versions.version_number(version)
    builds = preflight(mlflow_client, model_name, version)
    steps = require_feasible(policy, hooks.traffic) if hooks.traffic is not None else None
    served = dict.fromkeys((builds[0], builds[2], version))  # stable, fallback, candidate: in order, once each
    # a --reuse URL that does not answer is refused before any run, alias or server
    reused = {versions.version_number(v): reused_backend(v, url) for v, url in local.reuse.items()}
    if not served.keys() <= reused.keys():
        serving_versions(local.serve.python)  # a server will start: its env must work before the run is opened
    reap_stale(mlflow_client, model_name, policy.stale_after_s, by, hooks.log)  # runs whose controller died
    spec, status = _open_run(mlflow_client, model_name, version, builds, policy, by, hooks.log)
    if idle := sorted(reused.keys() - served.keys(), key=int):  # a pool of running servers, or a typo: said, not used
        serves = ", ".join(f"v{v}" for v in served)
        hooks.log(f"canary: --reuse {', '.join(idle)} not used: this canary serves only {serves}")
    if steps is not None:
        hooks.log(plan_line(policy, hooks.traffic, steps))
    servers = LocalServers(mlflow_client, model_name, local.serve, where.servers, Path(local.work_dir) / spec.run_id)
    with _recorded(spec, status) as run, servers as fleet:
        for v, backend in reused.items():
            fleet.reuse(v, backend)
        for v, role in ((spec.stable, "stable"), (spec.fallback, "shadow"), (version, "candidate")):
            fleet.start(v, role, hooks.log)
        router = Router(fleet.resolver(spec.stable), local.router_params, model_name=model_name)
        with (
            local_gateway(router, fleet.status, where.router.host, where.router.port) as gateway,
            contextlib.closing(GatewaySplit(gateway.admin_url, gateway.token, version, policy.gateway_lost_s)) as split,
        ):
            hooks.log(f"canary: router at {gateway.url}/v1 (OpenAI API), metrics at {gateway.url}/metrics")
            split.beat = status.beat
            _candidate_steps(spec, split, run, steps, hooks, status)
    return _report(run.outcome, hooks.log)


def _candidate_steps(spec: Spec, split: GatewaySplit, run: _Ledger, steps, hooks: Hooks, status: Status) -> None:
    """Point `candidate` at the spec's version, wait for the gateway to route to its warm server
    (warm_timeout_s), then walk the steps (_walk); the outcome goes to `run`."""
    version, policy = spec.version, spec.policy
    run.candidate_set = True  # before the write: a Ctrl-C or SIGTERM inside it must still clear it
    aliases.set_candidate(
        spec.client, spec.model, version, spec.by, f"canary run {spec.run_id}", canary_run_id=spec.run_id
    )
    hooks.log(f"canary: waiting for the gateway {split.url} to warm v{version} ({policy.warm_timeout_s:g} s at most)")
    try:
        state = split.wait_warm(version, policy.warm_timeout_s, hooks.stop, beat=status.beat)
    except QuantgateError:
        if not hooks.stop.is_set():
            raise
        run.outcome = Outcome("aborted", 0, 0.0, STOPPED, spec.run_id)  # the normal abort path: exit 3, run id said
        return
    split.attach(state)
    hooks.log(f"canary: v{version} is warm on the gateway {state.get('url')}/v1")
    run.outcome = _walk(spec, split, steps, hooks, status, state.get("url"))


def run_canary_on_gateway(
    mlflow_client, model_name: str, version, policy: CanaryPolicy, by: str, admin: Admin, hooks: Hooks | None = None
) -> Outcome:
    """Run one canary of `version` on the running `quantgate serve` whose admin endpoint is `admin`.

    As run_canary, except that the servers and the router are the gateway's (a given traffic is planned
    at the shadow_fraction the gateway reports): canary runs of this model whose controller died are
    recorded as aborted first (canary.status.reap_stale); setting `candidate` makes the gateway warm the
    version (waited for up to warm_timeout_s); the steps set the gateway's weight through its admin
    endpoint and analyse its samples; a gateway that restarts or stops answering mid-step is waited for up
    to gateway_lost_s, then the step resumes at its weight (tag canary.resumed), else the canary aborts.
    `hooks.on_router(url)` gets the gateway's public URL.
    """
    hooks = hooks or Hooks()
    log = hooks.log
    version = versions.version_number(version)
    builds = preflight(mlflow_client, model_name, version)
    with contextlib.closing(GatewaySplit(admin.url, admin.token, version, policy.gateway_lost_s)) as split:
        now = split.state()  # unreachable or a wrong token: QuantgateError before any change
        serves = now.get("model")
        if serves is not None and serves != model_name:
            raise QuantgateError(f"the gateway at {admin.url} serves {serves}, not {model_name}: give its own gateway")
        if hooks.traffic is not None and "shadow_fraction" in now:  # the share the gateway shadows, not ours
            hooks = dataclasses.replace(
                hooks, traffic=dataclasses.replace(hooks.traffic, shadow_fraction=now["shadow_fraction"])
            )
        steps = require_feasible(policy, hooks.traffic) if hooks.traffic is not None else None
        reap_stale(mlflow_client, model_name, policy.stale_after_s, by, log, set_weight=split.weight_or_nothing)
        spec, status = _open_run(mlflow_client, model_name, version, builds, policy, by, log)
        split.beat = status.beat
        if steps is not None:
            log(plan_line(policy, hooks.traffic, steps))
        with _recorded(spec, status) as run:
            _candidate_steps(spec, split, run, steps, hooks, status)
    return _report(run.outcome, log)
