"""How long a canary takes at the traffic it gets, and whether it can finish at all.

A check can PASS once it has policy.min_samples samples (per role for latency; a FAIL needs
no minimum, canary/analysis.py). At an offered rate of r requests/s, a share s of them
streaming (TTFT/TPOT come from streams only) and a share g greedy (only those are shadowed),
step i at p % of traffic gets per second

    error_rate        r p/100 candidate attempts
    latency           r s p/100 candidate streams and r s (1 - p/100) stable streams (at 100 %,
                      stable's streams of the earlier steps are the reference)
    shadow_agreement  r g f p/100 comparisons (f = the router's shadow_fraction, Traffic.shadow_fraction)

(only the checks policy.checks lists), and the vLLM gauge checks one scrape per look, so step i
needs t_i = max(min_step_s, min_samples / (the slowest of those rates), gauge_looks x
check_interval_s) seconds.
The wait for the m-th sample of a Poisson stream is Gamma(m, rate), sd / mean = 1/sqrt(m)
(22 % at m = 20), so a plan is refused when some t_i * SLACK > max_step_s: a step planned
that close to its limit would often end on max_step_s instead of a verdict. A step whose
checks are INCONCLUSIVE at t_i * SLACK ends there under `inconclusive: abort`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from canary.analysis import fail_level, latency_level
from canary.policy import GAUGES, CanaryPolicy
from gateway.metrics import Sample
from quantgate.errors import QuantgateError

SLACK = 1.5  # a step is planned to need at most max_step_s / SLACK


@dataclass(frozen=True)
class Traffic:
    """Offered traffic: requests/s, the share that streams and the share that is greedy;
    `source` says where the figures come from (e.g. "--load-rps", "measured over 30 s");
    `shadow_fraction` is the share of greedy candidate requests the router mirrors to the fallback
    (params.yaml fleet.router.shadow_fraction, the gateway's)."""

    rps: float
    stream_share: float = 0.5
    greedy_share: float = 1.0
    source: str = "given"
    shadow_fraction: float = 0.5


@dataclass(frozen=True)
class StepPlan:
    """One step at the offered traffic: the seconds it needs and which check needs them."""

    step: int  # 1-based
    percent: float
    seconds: float  # inf when a check gets no samples at all
    limiting: str  # e.g. "shadow_agreement", "latency (candidate streams)", "min_step_s"

    @property
    def end_s(self) -> float:
        """When an INCONCLUSIVE step ends under `inconclusive: abort`."""
        return self.seconds * SLACK


# what each limiting need asks the operator to change
_FIXES = {
    "error_rate": "canary.steps, canary.min_samples or canary.max_step_s",
    "latency (candidate streams)": "canary.steps, canary.min_samples or canary.max_step_s (or stream more requests)",
    "latency (stable streams)": "canary.steps (a lower share first), canary.min_samples or canary.max_step_s",
    "shadow_agreement": "fleet.router.shadow_fraction, canary.steps, canary.min_samples or canary.max_step_s",
    "min_step_s": "canary.min_step_s or canary.max_step_s",
    "vLLM gauges (gauge_looks)": "canary.gauge_looks, canary.check_interval_s or canary.max_step_s",
}


def plan(policy: CanaryPolicy, traffic: Traffic) -> tuple[StepPlan, ...]:
    """Each step's seconds at `traffic` (module docstring); pure."""
    m, r, out = policy.min_samples, traffic.rps, []
    latency = any(policy.check(n) for n in ("ttft_p95_ratio", "tpot_p95_ratio"))
    gauges = any(policy.check(n) for n in GAUGES)
    stable_before = 0.0  # stable streams collected in the earlier steps
    for i, percent in enumerate(policy.steps, 1):
        share = percent / 100
        rates = {"error_rate": r * share}  # always listed
        if latency:
            rates["latency (candidate streams)"] = r * traffic.stream_share * share
        if policy.check("shadow_agreement"):
            rates["shadow_agreement"] = r * traffic.greedy_share * traffic.shadow_fraction * share
        stable_rate = r * traffic.stream_share * (1 - share)
        # at 50 % the steps before collect exactly m stable streams in expectation: compare with a tolerance, or
        # float rounding (1.9999999 < 2) plans a 100 % step that never gets a sample
        if latency and (stable_rate > 0 or stable_before < m - 1e-6):
            rates["latency (stable streams)"] = stable_rate
        needs = {name: (m / rate if rate > 0 else float("inf")) for name, rate in rates.items()}
        if gauges:  # one scrape per look
            needs["vLLM gauges (gauge_looks)"] = policy.gauge_looks * policy.check_interval_s
        limiting = max(needs, key=needs.get)
        seconds, limiting = (
            (policy.min_step_s, "min_step_s") if needs[limiting] <= policy.min_step_s else (needs[limiting], limiting)
        )
        stable_before += stable_rate * seconds
        out.append(StepPlan(i, percent, seconds, limiting))
    return tuple(out)


def _fixes(limiting: str, traffic: Traffic) -> str:
    """What to change for the `limiting` need: _FIXES, without "stream more requests" for --load-rps traffic,
    whose streaming share is fixed."""
    fixes = _FIXES[limiting]
    return fixes.replace(" (or stream more requests)", "") if traffic.source == "--load-rps" else fixes


def refusal(policy: CanaryPolicy, traffic: Traffic, steps: Sequence[StepPlan]) -> str | None:
    """One line saying why the plan cannot finish within max_step_s and what to change; None if it can."""
    for s in steps:
        if s.end_s > policy.max_step_s:
            need = "never gets a sample" if s.seconds == float("inf") else f"needs about {s.seconds:.0f} s"
            return (
                f"canary plan cannot finish: at {traffic.rps:g} req/s ({traffic.source}) step {s.step} "
                f"({s.percent:g}%) {need} for min_samples={policy.min_samples} of {s.limiting}, over "
                f"max_step_s={policy.max_step_s:g} / {SLACK:g}; change {_fixes(s.limiting, traffic)}, or send more "
                "traffic"
            )
    return None


def require_feasible(policy: CanaryPolicy, traffic: Traffic) -> tuple[StepPlan, ...]:
    """plan(), or QuantgateError with refusal()'s line."""
    steps = plan(policy, traffic)
    why = refusal(policy, traffic, steps)
    if why:
        raise QuantgateError(why)
    return steps


def plan_line(policy: CanaryPolicy, traffic: Traffic, steps: Sequence[StepPlan]) -> str:
    """`canary: at 1 req/s (--load-rps) this plan needs about 12 min (step 1 (10%): 400 s, ...)`."""
    total = sum(s.seconds for s in steps)
    each = ", ".join(f"step {s.step} ({s.percent:g}%): {s.seconds:.0f} s" for s in steps)
    length = f"{total / 60:.0f} min" if total >= 90 else f"{total:.0f} s"  # a short plan is not "0 min"
    return (
        f"canary: at {traffic.rps:.3g} req/s ({traffic.source}; {traffic.stream_share:.0%} streaming, "
        f"{traffic.greedy_share:.0%} greedy) this plan needs about {length} ({each}); "
        f"a check FAILs at p <= {fail_level(policy):.2g} (error_rate, shadow_agreement: any look) "
        f"or {latency_level(policy):.2g} (latency, per look)"
    )


def measured_traffic(samples: Sequence[Sample], seconds: float, shadow_fraction: float = 0.5) -> Traffic:
    """Traffic from the router's first attempts of each request (not retries) over `seconds`, at the
    router's `shadow_fraction`. The greedy share is not recorded per sample and is taken as 1 (the load
    generator's)."""
    first = [s for s in samples if s.role in ("stable", "candidate") and not s.retried]
    if not first:
        raise QuantgateError(
            f"canary: no requests reached the router in {seconds:g} s (canary.measure_s); send traffic "
            "(e.g. --load-rps 1) or raise canary.measure_s"
        )
    stream = sum(s.stream for s in first) / len(first)
    return Traffic(len(first) / seconds, stream, 1.0, f"measured over {seconds:g} s", shadow_fraction)
