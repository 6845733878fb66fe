"""Which GPUs a step uses: `evaluate.serve.devices` (every vLLM server: evaluate, calibrate, canary,
`quantgate serve`) and `quantize.<build>.devices` (llm-compressor), as CUDA_VISIBLE_DEVICES.

A value is `auto` (whatever the machine shows: every GPU, or the CPU), `cpu` (no GPU, even where
there is one) or GPU indices as nvidia-smi numbers them ("0", "0,1"). Asking for a GPU on a
machine without one is one line naming the field, before anything starts.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from quantgate.errors import QuantgateError
from quantgate.params import PARAMS_FILE, key_lines

DEVICES_HELP = 'auto, cpu, or GPU indices such as "0" or "0,1"'


def check_devices(value: str) -> str:
    """`value` if it is a devices value (auto | cpu | comma-separated GPU indices); raises ValueError
    (pydantic reports it with the params.yaml line) otherwise."""
    if value in ("auto", "cpu") or re.fullmatch(r"\d+(,\d+)*", value):
        return value
    raise ValueError(f"{value!r} is not {DEVICES_HELP}")


def gpu_count() -> int:
    """GPUs the NVIDIA driver lists (`nvidia-smi -L`, one "GPU <i>: ..." line each); 0 where nvidia-smi
    is missing or fails (no driver, no device). Takes ~0.1 s with a GPU."""
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0


def visible_devices(devices: str, field: str, count: int | None = None) -> str | None:
    """CUDA_VISIBLE_DEVICES for params field `field` (e.g. "evaluate.serve.devices") = `devices`:
    None for auto (the environment is left as it is), "" for cpu, the indices otherwise.

    `count` is the machine's GPU count (gpu_count() when None). Raises QuantgateError, one line
    with the params.yaml line, when a GPU is asked for that the machine does not have.
    """
    if devices == "auto":
        return None
    if devices == "cpu":
        return ""
    count = gpu_count() if count is None else count
    wanted = [int(i) for i in devices.split(",")]
    if missing := [i for i in wanted if i >= count]:
        line = key_lines(PARAMS_FILE).get(tuple(field.split(".")))
        where = f"{PARAMS_FILE}:{line}: " if line else ""
        has = "no GPU (nvidia-smi lists none)" if count == 0 else f"{count} GPU(s), numbered from 0"
        raise QuantgateError(
            f"{where}{field}: GPU {','.join(map(str, missing))} requested, but this machine has {has}; "
            "set it to auto or cpu"
        )
    return devices
