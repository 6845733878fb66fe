"""The canary policy: frozen data from params.yaml block `canary`, applied by router/analysis.

Units: percent of traffic (steps), seconds (*_s), fractions in [0, 1] (rates, agreement).
Errors name the line and field, e.g. "params.yaml:60: canary.steps: ..." (quantgate.params.parse).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from gateway.fleet import ServerOverride
from quantgate.params import PARAMS_FILE, Frozen, load_block


class Servers(Frozen):
    stable: ServerOverride = ServerOverride()
    candidate: ServerOverride = ServerOverride()
    shadow: ServerOverride = ServerOverride()  # the fp16 `fallback` build


class RouterAddress(Frozen):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)  # 0 = a free port


# name -> (the side its range is bounded on, the values that bound may take as an interval
# written in the usual notation, what it measures)
CHECK_KINDS: dict[str, tuple[str, str, str]] = {
    "error_rate": ("max", "[0, 1)", "share of candidate attempts failing (5xx, timeout, refused)"),
    "ttft_p95_ratio": ("max", "(0, inf)", "p95 time to first token, candidate / stable (streams)"),
    "tpot_p95_ratio": ("max", "(0, inf)", "p95 time per output token, candidate / stable"),
    "shadow_agreement": ("min", "(0, 1]", "greedy candidate answers equal to the fp16 build's"),
    "vllm_requests_waiting": ("max", "[0, inf)", "candidate vLLM's queue: vllm:num_requests_waiting"),
    "vllm_kv_cache_usage": ("max", "(0, 1]", "candidate vLLM's KV-cache use: vllm:kv_cache_usage_perc, 0-1"),
}
STATISTICAL = ("error_rate", "ttft_p95_ratio", "tpot_p95_ratio", "shadow_agreement")  # share policy.alpha
GAUGES = ("vllm_requests_waiting", "vllm_kv_cache_usage")  # scraped from the candidate's own /metrics


def _within(x: float, interval: str) -> bool:
    """x in an interval written "[0, 1)", "(0, inf)", ..."""
    lo, hi = (float(v) for v in interval[1:-1].split(","))
    above = x >= lo if interval[0] == "[" else x > lo
    below = x <= hi if interval[-1] == "]" else x < hi
    return above and below


class CheckRange(Frozen):
    """One check as Flagger / Argo Rollouts write it: a metric and the range it must stay in,
    e.g. `{name: error_rate, max: 0.01}` or `{name: shadow_agreement, min: 0.4}`. Each metric is
    bounded on one side (CHECK_KINDS); how it is judged is canary/analysis.py's."""

    name: Literal[tuple(CHECK_KINDS)]  # type: ignore[valid-type]
    min: float | None = None
    max: float | None = None

    @model_validator(mode="after")
    def _one_side(self) -> "CheckRange":
        side, interval, what = CHECK_KINDS[self.name]
        other = "min" if side == "max" else "max"
        if getattr(self, other) is not None:
            raise ValueError(f"{self.name} ({what}) is bounded by `{side}` only; remove `{other}`")
        bound = getattr(self, side)
        if bound is None:
            raise ValueError(f"{self.name} needs `{side}`, e.g. {{name: {self.name}, {side}: ...}}")
        if not _within(bound, interval):
            raise ValueError(f"{self.name}.{side} must be in {interval}, got {bound:g}")
        return self

    @property
    def bound(self) -> float:
        """The threshold: `max` or `min`, whichever the metric is bounded by."""
        return self.max if self.max is not None else self.min  # type: ignore[return-value]

    def __str__(self) -> str:
        lo = f"{self.min:g} <= " if self.min is not None else ""
        hi = f" <= {self.max:g}" if self.max is not None else ""
        return f"{lo}{self.name}{hi}"


DEFAULT_CHECKS = (
    CheckRange(name="error_rate", max=0.01),
    CheckRange(name="ttft_p95_ratio", max=1.5),
    CheckRange(name="tpot_p95_ratio", max=1.5),
    CheckRange(name="shadow_agreement", min=0.4),
    CheckRange(name="vllm_requests_waiting", max=4),
    CheckRange(name="vllm_kv_cache_usage", max=0.9),
)


def _retired(key: str, value: object) -> str | None:
    """What to do with `key`, a key this block no longer takes (from an older params.yaml); None for a live key."""
    if key in ("router", "servers"):
        why = "ports and cores apart from the policy"
        return f"canary.{key} moved to the block `canary_topology` ({why}): move it there"
    if key in ("request_timeout_s", "connect_timeout_s", "shadow_fraction", "shadow_compare_words"):
        why = "the gateway's, which applies it to every request"
        return f"canary.{key} moved to fleet.router.{key} ({why}): move it there"
    if key in ("max_error_rate", "max_ttft_p95_ratio", "max_tpot_p95_ratio", "min_shadow_agreement"):
        side, name = key.split("_", 1)
        return f"canary.{key} is now an entry of canary.checks: `- {{name: {name}, {side}: {value}}}`; delete {key}"
    why = {
        "min_requests_per_step": "a step's length now follows from min_samples and the traffic (canary/plan.py)",
        "failure_limit": "one FAIL aborts: each check's test holds alpha over every look (canary/analysis.py)",
    }.get(key)
    return f"canary.{key}: removed: {why}; delete this key" if why else None


class CanaryPolicy(Frozen):
    """How a candidate build is moved through the fleet and judged at each step."""

    steps: list[float] = Field(default=[10, 25, 50, 100], min_length=1)  # % of traffic to the candidate
    min_step_s: float = Field(default=60, gt=0)  # a step lasts at least this long, whatever the traffic
    max_step_s: float = Field(default=900, gt=0)
    check_interval_s: float = Field(default=5, gt=0)  # seconds between looks at a step's samples
    measure_s: float = Field(default=30, gt=0)  # traffic measured at 0 % before step 1 when no rate is given
    checks: list[CheckRange] = Field(default=list(DEFAULT_CHECKS), min_length=1)  # Flagger/Argo-style ranges
    gauge_looks: int = Field(default=3, ge=1)  # a vLLM gauge check FAILs above its max at this many looks in a row
    min_samples: int = Field(default=20, ge=2)  # per role and check before a check may PASS
    alpha: float = Field(default=0.05, gt=0, lt=0.5)  # false FAIL of a build meeting every threshold, per canary
    inconclusive: Literal["abort", "hold"] = "hold"  # at the step's planned end: abort, or collect until max_step_s
    # on a running gateway (`canary run --gateway`): seconds for the candidate's server to get warm,
    # for a gateway that restarted or stopped answering to come back (then the step resumes, else
    # abort), and without a heartbeat before another process records the canary as aborted
    warm_timeout_s: float = Field(default=600, gt=0)
    gateway_lost_s: float = Field(default=300, gt=0)
    stale_after_s: float = Field(default=120, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _retired_keys(cls, data: object) -> object:
        if isinstance(data, dict):
            for key, value in data.items():
                if (why := _retired(key, value)) is not None:
                    raise ValueError(why)
        return data

    @field_validator("stale_after_s")
    @classmethod
    def _above_the_heartbeat(cls, v: float, info: ValidationInfo) -> float:
        beat = info.data.get("check_interval_s")
        if beat is not None and v < 3 * beat:  # a live controller beats once per look
            raise ValueError(
                f"must be >= 3 x check_interval_s ({3 * beat:g} s), or live canaries are reaped; got {v:g}: raise "
                "it, or lower check_interval_s"
            )
        return v

    def check(self, name: str) -> CheckRange | None:
        """The listed check called `name`, or None when the policy does not judge it."""
        return next((c for c in self.checks if c.name == name), None)

    def with_bounds(self, **bounds: float) -> "CanaryPolicy":
        """A copy with the named listed checks' bounds replaced, e.g. with_bounds(ttft_p95_ratio=50).
        Raises ValueError for a name the policy does not list."""
        unknown = set(bounds) - {c.name for c in self.checks}
        if unknown:
            raise ValueError(f"not listed in canary.checks: {', '.join(sorted(unknown))}")
        checks = [
            c.model_copy(update={CHECK_KINDS[c.name][0]: float(bounds[c.name])}) if c.name in bounds else c
            for c in self.checks
        ]
        return self.model_copy(update={"checks": checks})

    @field_validator("checks")
    @classmethod
    def _error_rate_and_once_each(cls, checks: list[CheckRange]) -> list[CheckRange]:
        names = [c.name for c in checks]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"each check once; {', '.join(twice)} is listed twice")
        if "error_rate" not in names:  # fail closed: a canary that cannot see failures must not promote
            raise ValueError("error_rate must be listed (e.g. `- {name: error_rate, max: 0.01}`)")
        return checks

    @field_validator("steps")
    @classmethod
    def _increasing_percentages(cls, steps: list[float]) -> list[float]:
        if any(not 0 < s <= 100 for s in steps):
            raise ValueError(f"each step is a percent of traffic in (0, 100], got {steps}")
        if any(a >= b for a, b in zip(steps, steps[1:], strict=False)):
            raise ValueError(f"steps must increase strictly, got {steps}")
        if steps[-1] != 100:  # promotion moves production: the candidate must have carried all of it
            raise ValueError(f"the last step must be 100 (all traffic on the candidate before promotion), got {steps}")
        return steps

    @field_validator("max_step_s")
    @classmethod
    def _not_below_min(cls, v: float, info: ValidationInfo) -> float:
        low = info.data.get("min_step_s")
        if low is not None and v < low:
            raise ValueError(f"must be >= min_step_s ({low:g}), got {v:g}")
        return v


class CanaryTopology(Frozen):
    """Where a canary runs (block `canary_topology`): the router's address and each role's vLLM
    server changes; kept apart from the policy's thresholds (block `canary`)."""

    router: RouterAddress = RouterAddress()
    servers: Servers = Servers()

    @model_validator(mode="after")
    def _ports_apart(self) -> CanaryTopology:
        """Raises ValueError when two listeners of one canary share a port (0, a free port each, never does):
        the router and any server, or the candidate and the stable or shadow server. The shadow may share the
        stable server's port: it is usually the stable server itself."""
        s = self.servers
        pairs = [
            ("router.port", self.router.port, f"servers.{role}.port", getattr(s, role).port)
            for role in ("stable", "candidate", "shadow")
        ]
        pairs += [
            ("servers.candidate.port", s.candidate.port, f"servers.{r}.port", getattr(s, r).port)
            for r in ("stable", "shadow")
        ]
        for a, port, b, other in pairs:
            if port and port == other:
                raise ValueError(f"{a} {port} is also {b}; give each its own port, or 0 for a free one")
        return self


def load_policy(path: Path = PARAMS_FILE) -> CanaryPolicy:
    """Block `canary` of params.yaml. Raises QuantgateError naming params.yaml:<line>: canary.<field>."""
    return load_block("canary", CanaryPolicy, path)


def load_topology(path: Path = PARAMS_FILE) -> CanaryTopology:
    """Block `canary_topology` of params.yaml. Raises QuantgateError naming
    params.yaml:<line>: canary_topology.<field>."""
    return load_block("canary_topology", CanaryTopology, path)
