"""The canary policy: frozen data from params.yaml block `canary`, applied by router/analysis.

Units: percent of traffic (steps), seconds (*_s), fractions in [0, 1] (rates, agreement).
Errors name the line and field, e.g. "params.yaml:60: canary.steps: ..." (quantgate.params.parse).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from quantgate.params import PARAMS_FILE, Frozen, load_block
from quantgate.serving import ServeParams, no_dtype_arg


class ServerOverride(Frozen):
    """Per-role changes to `evaluate.serve` for a canary vLLM server."""

    port: int = Field(default=0, ge=0, le=65535)  # 0 = a free port
    cpu_cores: str | None = None  # vLLM CPU: cores for this server's worker (VLLM_CPU_OMP_THREADS_BIND)
    extra_args: list[str] = []  # appended to evaluate.serve.extra_args

    _one_precision = field_validator("extra_args")(classmethod(lambda cls, args: no_dtype_arg(args)))


class Servers(Frozen):
    stable: ServerOverride = ServerOverride()
    candidate: ServerOverride = ServerOverride()
    shadow: ServerOverride = ServerOverride()  # the fp16 `fallback` build


class RouterAddress(Frozen):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)  # 0 = a free port


@dataclass(frozen=True)
class CheckRange:
    """One check as Flagger / Argo Rollouts write it: a metric and the range it must stay in
    (None = unbounded on that side); a view of CanaryPolicy's thresholds, see `checks()`."""

    name: str  # as canary/analysis.py names the check
    min: float | None
    max: float | None

    def __str__(self) -> str:
        lo = f"{self.min:g} <= " if self.min is not None else ""
        hi = f" <= {self.max:g}" if self.max is not None else ""
        return f"{lo}{self.name}{hi}"


class CanaryPolicy(Frozen):
    """How a candidate build is moved through the fleet and judged at each step."""

    steps: list[float] = Field(default=[10, 25, 50, 100], min_length=1)  # % of traffic to the candidate
    min_step_s: float = Field(default=60, gt=0)  # a step lasts at least this long, whatever the traffic
    max_step_s: float = Field(default=900, gt=0)
    check_interval_s: float = Field(default=5, gt=0)  # seconds between looks at a step's samples
    measure_s: float = Field(default=30, gt=0)  # traffic measured at 0 % before step 1 when no rate is given
    max_error_rate: float = Field(default=0.01, ge=0, lt=1)  # candidate 5xx/timeout/refused share
    max_ttft_p95_ratio: float = Field(default=1.5, gt=0)  # candidate p95 / stable p95
    max_tpot_p95_ratio: float = Field(default=1.5, gt=0)
    min_shadow_agreement: float = Field(default=0.7, gt=0, le=1)  # vs the fp16 build, greedy requests
    min_samples: int = Field(default=20, ge=2)  # per role and check before a check may PASS
    alpha: float = Field(default=0.05, gt=0, lt=0.5)  # false FAIL of a build meeting every threshold, per canary
    min_requests_per_step: None = Field(default=None, exclude=True)  # removed (issue 16): see _removed
    failure_limit: None = Field(default=None, exclude=True)  # removed (issue 16): see _removed
    inconclusive: Literal["abort", "hold"] = "hold"  # at the step's planned end: abort, or collect until max_step_s
    shadow_fraction: float = Field(default=0.5, ge=0, le=1)  # of greedy candidate requests
    shadow_compare_words: int = Field(default=8, ge=1)
    request_timeout_s: float = Field(default=60, gt=0)  # per backend attempt; see canary/router.py
    connect_timeout_s: float = Field(default=5, gt=0)
    # on a running gateway (`canary run --gateway`): seconds for the candidate's server to get warm,
    # for a gateway that restarted or stopped answering to come back (then the step resumes, else
    # abort), and without a heartbeat before another process records the canary as aborted
    warm_timeout_s: float = Field(default=600, gt=0)
    gateway_lost_s: float = Field(default=300, gt=0)
    stale_after_s: float = Field(default=120, gt=0)
    router: RouterAddress = RouterAddress()

    @field_validator("stale_after_s")
    @classmethod
    def _above_the_heartbeat(cls, v: float, info: ValidationInfo) -> float:
        beat = info.data.get("check_interval_s")
        if beat is not None and v < 3 * beat:  # a live controller beats once per look
            raise ValueError(
                f"must be >= 3 x check_interval_s ({3 * beat:g} s), or live canaries are reaped; got {v:g}"
            )
        return v

    servers: Servers = Servers()

    def checks(self) -> tuple[CheckRange, ...]:
        """The thresholds as checks with ranges, in canary/analysis.py's order (a view; params unchanged)."""
        return (
            CheckRange("error_rate", None, self.max_error_rate),
            CheckRange("ttft_p95_ratio", None, self.max_ttft_p95_ratio),
            CheckRange("tpot_p95_ratio", None, self.max_tpot_p95_ratio),
            CheckRange("shadow_agreement", self.min_shadow_agreement, None),
        )

    @field_validator("steps")
    @classmethod
    def _increasing_percentages(cls, steps: list[float]) -> list[float]:
        if any(not 0 < s <= 100 for s in steps):
            raise ValueError(f"each step is a percent of traffic in (0, 100], got {steps}")
        if any(a >= b for a, b in zip(steps, steps[1:], strict=False)):
            raise ValueError(f"steps must increase strictly, got {steps}")
        return steps

    @field_validator("min_requests_per_step", "failure_limit", mode="before")
    @classmethod
    def _removed(cls, v: object, info: ValidationInfo) -> None:
        why = {
            "min_requests_per_step": "a step's length now follows from min_samples and the traffic (canary/plan.py)",
            "failure_limit": "one FAIL aborts: each check's test holds alpha over every look (canary/analysis.py)",
        }[info.field_name]
        raise ValueError(f"removed in issue 16: {why}; delete this key")

    @field_validator("max_step_s")
    @classmethod
    def _not_below_min(cls, v: float, info: ValidationInfo) -> float:
        low = info.data.get("min_step_s")
        if low is not None and v < low:
            raise ValueError(f"must be >= min_step_s ({low:g}), got {v:g}")
        return v


def load_policy(path: Path = PARAMS_FILE) -> CanaryPolicy:
    """Block `canary` of params.yaml. Raises QuantgateError naming params.yaml:<line>: canary.<field>."""
    return load_block("canary", CanaryPolicy, path)


def serve_params(base: ServeParams, override: ServerOverride) -> ServeParams:
    """`evaluate.serve` with a role's port, CPU cores and extra vLLM args (appended) applied."""
    data = base.model_dump()
    data.update(port=override.port, extra_args=[*base.extra_args, *override.extra_args])
    if override.cpu_cores:
        data["cpu_cores"] = override.cpu_cores
    return ServeParams.model_validate(data)
