"""params.yaml's `profile` block (the load each build is measured under), read by the profile stage and checked by
validate before any stage runs."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from quantgate.params import Frozen
from quantgate.serving import check_cpu_cores


class ProfileParams(Frozen):
    """params.yaml block `profile`: the load each build is measured under (defaults: 15-40 s of benchmark per
    build on 2 CPU cores, on the server the build's evaluate shares: pipeline/README.md)."""

    # requests in flight, one benchmark each (vLLM bench's semaphore: 0 would mean unbounded)
    concurrency: list[Annotated[int, Field(ge=1)]] = Field(default=[1, 8], min_length=1)
    prompts_per_concurrency: int = Field(default=2, ge=1)  # N: each concurrency C sends max(N, C) prompts
    input_len: int = Field(default=32, ge=1)  # prompt tokens (random, fixed by seed)
    # generated tokens per request (ignore_eos); TPOT = (last token's time - first's) / (output_len - 1) needs 2
    output_len: int = Field(default=16, ge=2)
    seed: int = Field(default=1234, ge=0, le=2**32 - 1)  # the prompt set: every build gets the same (np.random.seed)
    timeout_s: int = Field(default=600, ge=1)  # per benchmark run, seconds
    cpu_cores: str | None = None  # VLLM_CPU_OMP_THREADS_BIND for the server; None = evaluate.serve's

    _cores = field_validator("cpu_cores")(classmethod(lambda cls, value: check_cpu_cores(value)))

    @field_validator("concurrency")
    @classmethod
    def _once_each(cls, value: list[int]) -> list[int]:
        """Each concurrency once: the figures are kept per concurrency, so a repeat ran its benchmark again
        (up to timeout_s) only to replace the first run's figures."""
        if again := sorted({c for c in value if value.count(c) > 1}):
            times = "twice" if (n := value.count(again[0])) == 2 else f"{n} times"
            raise ValueError(f"{again[0]} is given {times} in {value}; give each concurrency once")
        return value
