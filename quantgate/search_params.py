"""params.yaml's `search` block (the int4-mixed search, pipeline/search.py) and the pairing rules between it
and the quantize blocks, read by the search stage and checked by validate before any stage runs."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from quantgate.errors import QuantgateError
from quantgate.params import Frozen, where

SEARCH_RECIPE = "results/search/recipe.yaml"  # the search stage's out (dvc.yaml): search.build's recipe


class SearchParams(Frozen):
    """params.yaml block `search`."""

    build: str = Field(
        default="int4-mixed", min_length=1
    )  # the build whose recipe this writes (its quantize block names OUT_DIR/recipe.yaml)
    recipe: str = "recipes/int4.yaml"  # the recipe (scheme, method) the search falls back from: int4's
    # the build made with `recipe` (quantize.<base>.recipe): its profile, with the 16-bit build's, prices the
    # candidates; dvc.yaml lists results/profile/<base>.json among the stage's deps, so DVC profiles it first
    base: str = "int4"
    # below this relative throughput difference between fp16 and the base build, the profiles say nothing about
    # which kernel is faster and candidates are priced by bits (profile TPOT moved ~15 % between runs here)
    min_speed_difference: float = Field(default=0.15, ge=0, lt=1)
    looks: list[int] = Field(default=[40, 80, 160], min_length=1)  # first documents per task at each look
    doc_budget: int = Field(default=1500, gt=0)  # candidate documents scored over the whole search, every look
    # bits per weight a candidate may hold (its targeted layers; kept ones at 16): the int4-class bound. Above
    # ~6, int8 (W8A8, ~8 bits with scales, native kernels on every machine kind) frees about as much memory
    # with far less quality risk. None = no bound (candidates up to every layer but one 16-bit). At least 4: no
    # int4 candidate holds fewer (the exact floor, the base recipe's own bits with its scales and 16-bit layers,
    # needs the model's shapes: the search stage checks it); at most 16: a bound no candidate can exceed is null
    max_bits_per_weight: float | None = Field(default=6.0, ge=4, le=16)
    kl_samples: int = Field(default=4, gt=0)  # calibration conversations for the sensitivity ranking
    kl_seq_len: int = Field(default=128, gt=0)  # tokens of each
    # layers vLLM loads as one fused module, kept or quantized together: {fused name: member layer names};
    # vLLM's packed_modules_mapping for Llama, Mistral, Qwen2 (vllm/model_executor/models/llama.py)
    fused: dict[str, list[str]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data):
        if isinstance(data, dict) and (old := [k for k in REPLACED if k in data]):
            raise ValueError(f"search.{old[0]} was replaced: {REPLACED[old[0]]}")
        return data

    @field_validator("fused")
    @classmethod
    def _groups(cls, fused: dict[str, list[str]]) -> dict[str, list[str]]:
        # vLLM loads a fused module's members as one weight: a member in two groups, or twice in one, would
        # let the search keep part of a fused module 16-bit, which vLLM cannot load
        seen: dict[str, str] = {}
        for name, members in fused.items():
            if len(members) < 2:
                raise ValueError(f"fused.{name} must list the two or more layers vLLM loads as {name}; got {members}")
            for m in members:
                if m in seen:
                    where = "twice" if seen[m] == name else f"in fused.{seen[m]} too"
                    raise ValueError(f"fused.{name} lists {m} {where}: a layer belongs to one fused module, once")
                seen[m] = name
        return fused

    @field_validator("looks")
    @classmethod
    def _growing(cls, looks: list[int]) -> list[int]:
        if any(n <= 0 for n in looks) or looks != sorted(set(looks)):
            raise ValueError(f"looks must be growing document counts above 0, e.g. [40, 80, 160]; got {looks}")
        return looks


# keys of an older search block and what took their place (screens are sequential now: quantgate/screening.py)
REPLACED = {
    "max_evals": "the search spends search.doc_budget (candidate documents scored) instead of a count of screens",
    "screen_limit": "each screen looks at search.looks documents per task in turn, e.g. [40, 80, 160]",
    "screen_fraction": "a team passes a screen when the gate's interval puts its drop within the margin",
}


def same_path(a: object, b: str) -> bool:
    """Whether params value `a` is a string naming the path `b` (./x, x and /abs/x are one file; relative
    paths are read from the working folder, the repository root under `dvc repro`)."""
    return isinstance(a, str) and bool(a) and Path(a).resolve() == Path(b).resolve()


def check_base(p: SearchParams, quantize: dict, path: Path) -> None:
    """Raise QuantgateError (naming `path`'s line of search.base and quantize.<base>.recipe) unless search.base
    is made with search.recipe and served as the candidates are (not as W4A8), as read from `quantize`
    (params.yaml's quantize blocks, as written): the base's profile prices the candidates as the recipe the
    search falls back from. Recipe paths compare as paths."""
    block = quantize.get(p.base) if isinstance(quantize, dict) else None
    recipe = block.get("recipe") if isinstance(block, dict) else None
    if not same_path(recipe, p.recipe):
        raise QuantgateError(
            f"{where(path, 'search.base')}: search.base {p.base} is made with {recipe} (quantize.{p.base}.recipe), "
            f"not with search.recipe {p.recipe}; name the build made with the recipe the search falls back from"
        )
    if block.get("w4a8") is True:  # its profile would price W4A16 candidates at another kernel's speed
        raise QuantgateError(
            f"{where(path, f'quantize.{p.base}.w4a8')}: search.base {p.base} is served as W4A8 "
            f"(quantize.{p.base}.w4a8), and the search's candidates are served as W4A16, so its profile cannot price "
            f"them; drop quantize.{p.base}.w4a8 (to serve its weights as W4A8 too, add a build of its own with the "
            "same recipe and w4a8: true)"
        )
