"""params.yaml's `profile` block (the load each build is measured under), read by the profile stage and checked by
validate before any stage runs."""

from __future__ import annotations

from pydantic import Field

from quantgate.params import Frozen


class ProfileParams(Frozen):
    """params.yaml block `profile`: the load each build is measured under (defaults: ~1-2 min per build
    on 2 CPU cores, server start included)."""

    concurrency: list[int] = Field(default=[1, 8], min_length=1)  # requests in flight, one benchmark each
    prompts_per_concurrency: int = Field(default=2, ge=1)  # N: each concurrency C sends max(N, C) prompts
    input_len: int = Field(default=32, ge=1)  # prompt tokens (random, fixed by seed)
    output_len: int = Field(default=16, ge=1)  # generated tokens per request (ignore_eos)
    seed: int = 1234  # the prompt set: every build gets the same prompts
    timeout_s: int = Field(default=600, ge=1)  # per benchmark run, seconds
    cpu_cores: str | None = None  # VLLM_CPU_OMP_THREADS_BIND for the server; None = evaluate.serve's
