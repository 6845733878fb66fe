"""params.yaml's `quantize.<build>` block: what the quantize stage reads to make one build, and what validate
checks of it before any stage runs."""

from __future__ import annotations

import json

from pydantic import field_validator

from quantgate.conversations import Calibration
from quantgate.devices import check_devices
from quantgate.params import Frozen
from quantgate.precision import KvCacheDtype


class QuantizeParams(Frozen):
    """params.yaml block `quantize.<build>`."""

    recipe: str  # llm-compressor recipe YAML, e.g. recipes/int4.yaml
    calibration: Calibration | None = None  # required when the recipe needs data
    devices: str = "auto"  # GPUs llm-compressor uses (CUDA_VISIBLE_DEVICES): auto | cpu | "0" | "0,1"

    _devices = field_validator("devices")(classmethod(lambda cls, value: check_devices(value)))
    kv_cache_dtype: KvCacheDtype = "auto"  # vLLM --kv-cache-dtype every server of this build uses (build.json)
    # serve the W4A16 weights with int8 activations (vLLM CPU's W4A8 path on AMX, VLLM_CPU_INT4_W4A8=1), recorded
    # in build.json so every server of the build does; refused where vLLM would serve W4A16 (quantgate.precision)
    w4a8: bool = False

    @field_validator("w4a8", mode="before")
    @classmethod
    def _w4a8_is_a_boolean(cls, value):
        if not isinstance(value, bool):  # pydantic would take "yes", 1 or "true" as a bool, and say little otherwise
            raise ValueError(f"{json.dumps(value)} is not true or false; write w4a8: true, or leave it out")
        return value
