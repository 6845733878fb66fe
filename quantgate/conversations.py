"""The calibrate stage's conversations (results/calibration.jsonl), as the calibrated recipes read them.

One JSON object per line, `{"text": <the conversation in the 16-bit build's chat template>, ...}`, in a
fixed order: quantize (GPTQ, SmoothQuant, AWQ) and search (the per-layer KL ranking) both take the first N.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from quantgate.errors import QuantgateError
from quantgate.jsonl import read_jsonl
from quantgate.params import Frozen

CALIBRATION_FILE = Path("results/calibration.jsonl")  # the calibrate stage's out (dvc.yaml)


class Calibration(Frozen):
    """params.yaml quantize.<build>.calibration: what a calibrated recipe reads (quantize), and what the search's
    stand-in for it reads (an activation-weighted observer's statistics)."""

    samples: int = Field(default=256, gt=0)  # conversations from the calibrate stage
    seq_len: int = Field(default=512, gt=0)  # tokens per sample; longer ones are truncated
    pipeline: Literal["basic", "sequential"] = "sequential"  # sequential: layer by layer, on quantized inputs


def calibration_texts(path: Path, samples: int, field: str) -> list[str]:
    """The first `samples` conversations (chat-templated text) of the calibrate stage's file at `path`.

    `field` names the params field that asked for `samples` (e.g. quantize.int4.calibration.samples).
    Raises QuantgateError in one line if the file is missing, a line is not {"text": ...}, or it is short.
    """
    if not path.is_file():
        raise QuantgateError(f"{path}: no calibration conversations; run the calibrate stage (`dvc repro calibrate`)")
    rerun = "re-run the calibrate stage (`dvc repro calibrate`)"
    texts = []
    for number, row in read_jsonl(path, rerun):
        if not (isinstance(row, dict) and isinstance(row.get("text"), str)):
            raise QuantgateError(f'{path}:{number}: expected {{"text": "<conversation>", ...}}; {rerun}')
        texts.append(row["text"])
    if len(texts) < samples:
        raise QuantgateError(
            f"{path}: {len(texts)} calibration conversations, {samples} asked for ({field}); "
            "raise calibrate.samples or lower it"
        )
    return texts[:samples]
