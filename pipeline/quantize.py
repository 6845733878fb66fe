"""Stage `quantize@<build>`: one quantized build with llm-compressor `oneshot`.

Run by DVC: `python -m pipeline.quantize BUILD SRC_DIR OUT_DIR` (params block `quantize.<BUILD>`).

Schemes: FP8_DYNAMIC (no calibration) and W4A16 (4-bit weights in groups, 16-bit
activations) with GPTQ on calibration text (default) or RTN (round-to-nearest). lm_head stays 16-bit.
Output: compressed-tensors safetensors that vLLM loads unchanged, plus build.json.
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from functools import reduce
from pathlib import Path
from typing import Literal

from pydantic import Field

from quantgate.console import log_progress, per_build
from quantgate.errors import QuantgateError, run_main
from quantgate.manifest import read_manifest, write_manifest
from quantgate.params import Frozen, load_block


class QuantizeParams(Frozen):
    scheme: Literal["FP8_DYNAMIC", "W4A16"]
    algorithm: Literal["rtn", "gptq"] = "rtn"
    group_size: int | None = Field(default=None, gt=0)  # W4A16 only: weights per quantization group
    symmetric: bool = True
    dampening_frac: float = Field(default=0.01, gt=0, lt=1)
    calibration_samples: int = Field(default=32, gt=0)
    calibration_seq_len: int = Field(default=256, gt=0)  # tokens
    calibration_pipeline: Literal["basic", "sequential"] = "basic"
    ignore: list[str] = ["lm_head"]


def check_group_size(model, group_size: int, ignore: list[str]) -> None:
    """Raise QuantgateError unless `group_size` divides the input width of every quantized Linear.

    Names the first offending layer and lists the group sizes that would work (divisors
    of the gcd of the widths that are powers of two, as kernels expect).
    """
    import torch

    widths = {
        name: m.in_features
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not any(name.endswith(i) for i in ignore)
    }
    bad = [(name, w) for name, w in widths.items() if w % group_size]
    if bad:
        g = reduce(math.gcd, widths.values())
        ok = [2**k for k in range(4, 12) if g % 2**k == 0]
        raise QuantgateError(
            f"quantize.*.group_size={group_size} does not divide the input width {bad[0][1]} of layer "
            f"{bad[0][0]} ({len(bad)} layers affected); use one of {ok} (gcd of widths = {g})"
        )


def recipe(p: QuantizeParams):
    """The llm-compressor modifier for these params."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    if p.scheme == "FP8_DYNAMIC":
        return QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=p.ignore)
    if p.group_size is None:
        raise QuantgateError("quantize.*.group_size is required for W4A16")
    groups = {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": p.symmetric,
                "strategy": "group",
                "group_size": p.group_size,
            },
        }
    }
    if p.algorithm == "gptq":
        return GPTQModifier(config_groups=groups, ignore=p.ignore, dampening_frac=p.dampening_frac)
    return QuantizationModifier(config_groups=groups, ignore=p.ignore)


def calibration_dataset(tokenizer, p: QuantizeParams):
    """Tokenized calibration set (datasets.Dataset with input_ids/attention_mask)."""
    from datasets import Dataset

    from pipeline.calibration import texts

    ds = Dataset.from_dict({"text": texts(tokenizer, p.calibration_samples)})
    return ds.map(
        lambda s: tokenizer(s["text"], max_length=p.calibration_seq_len, truncation=True, add_special_tokens=False),
        remove_columns=["text"],
    )


def recipe_record(p: QuantizeParams, source_digest: str) -> dict:
    """The `recipe` of a build's manifest (build.json): every parameter but the scheme, and the
    sha256 digest of the 16-bit weights it was made from. Equal records = the same build recipe."""
    return {
        "algorithm": p.algorithm,
        **p.model_dump(exclude={"algorithm", "scheme"}),
        "source_weights_sha256": source_digest,
    }


def quantize(build: str, src: Path, out: Path, p: QuantizeParams) -> dict:
    """Quantize the build in `src` into `out`; return the new manifest."""
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.smoke import smoke_generate

    base = read_manifest(src)
    # load the 16-bit build
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(src)
    # validate before spending minutes on calibration
    if p.scheme == "W4A16":
        check_group_size(model, p.group_size, p.ignore)
    # apply the recipe; only calibrated algorithms get data
    started = time.monotonic()
    if p.algorithm == "rtn" or p.scheme == "FP8_DYNAMIC":
        oneshot(model=model, recipe=recipe(p))
    else:
        oneshot(
            model=model,
            recipe=recipe(p),
            dataset=calibration_dataset(tokenizer, p),
            max_seq_length=p.calibration_seq_len,
            num_calibration_samples=p.calibration_samples,
            pipeline=p.calibration_pipeline,
        )
    print(f"quantize[{build}]: {p.scheme}/{p.algorithm} in {time.monotonic() - started:.1f} s", flush=True)
    # smoke generation: a broken build shows here first
    print(f"quantize[{build}]: smoke answer: {smoke_generate(model, tokenizer)!r}", flush=True)
    # save compressed-tensors
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    return write_manifest(
        out,
        build=build,
        scheme=p.scheme,
        dtype=base["dtype"],
        base_model=base["base_model"],
        recipe=recipe_record(p, base["weights_digest"]),
    )


def main() -> None:
    if len(sys.argv) != 4:
        raise QuantgateError("usage: python -m pipeline.quantize BUILD SRC_DIR OUT_DIR")
    build, src, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    with log_progress(r"Quantizing (\d+) module", desc=f"quantize[{build}]: GPTQ", unit="module"):
        manifest = quantize(build, src, out, load_block(f"quantize.{build}", QuantizeParams))
    print(f"quantize[{build}]: wrote {out} (digest {manifest['weights_digest'][:12]})")


if __name__ == "__main__":
    run_main(main, log=per_build("quantize"))
