"""llm-compressor recipe files: parse and check them before any model is quantized.

A recipe is a YAML file in llm-compressor's own format (`<name>_stage: <group>_modifiers: <Modifier>:
{args}`). Shared by the quantize stage and the search stage (which writes int4-mixed's recipe).
"""

from __future__ import annotations

import math
from functools import reduce
from pathlib import Path

from quantgate.conversations import Calibration
from quantgate.errors import QuantgateError
from quantgate.params import read_yaml


def load_recipe(build: str, path: Path, field: str | None = None):
    """Parse the recipe YAML at `path` with llm-compressor (llmcompressor.recipe.Recipe).

    Returns the Recipe. Raises QuantgateError in one line naming the file and `field` (default
    quantize.<build>.recipe) when
    it is missing, not YAML, names an unknown modifier, gives a modifier a bad argument, or has none.
    """
    from llmcompressor.recipe import Recipe
    from pydantic import ValidationError

    where = f"{path} ({field or f'quantize.{build}.recipe'})"
    if not path.is_file():
        raise QuantgateError(f"{where}: recipe file not found; add it under recipes/ or fix the path")
    if not isinstance(read_yaml(path), dict):  # read_yaml names the line of a YAML error
        raise QuantgateError(
            f"{where}: a recipe is a mapping `quant_stage: quant_modifiers: <Modifier>: {{...}}` "
            "(see recipes/README.md)"
        )
    try:
        recipe = Recipe.create_instance(str(path))
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        raise QuantgateError(f"{where}: {exc.title}.{field}: {err['msg']} (got {err.get('input')!r})") from None
    except Exception as exc:  # llm-compressor raises ValueError/yaml errors/TypeError for bad recipes
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise QuantgateError(f"{where}: llm-compressor rejects this recipe: {first}") from None
    if not recipe.modifiers:
        raise QuantgateError(
            f"{where}: no modifiers; a recipe reads `quant_stage: quant_modifiers: <Modifier>: {{...}}` "
            "(see recipes/README.md)"
        )
    return recipe


def declared_schemes(path: Path) -> list[str]:
    """The schemes a recipe YAML declares, read as YAML (no llm-compressor import, so validate can ask): each
    modifier's `scheme` preset name (a string, or the keys of a {preset: targets} mapping), and "W<bits>A<bits>"
    for each of its `config_groups` (weights' num_bits, input_activations' or 16; "FP" for float weights).
    Empty when it declares none that this reading knows; the quantize stage's parse then decides."""
    found: list[str] = []

    def walk(node) -> None:
        if not isinstance(node, dict):
            return
        scheme = node.get("scheme")
        if isinstance(scheme, str):
            found.append(scheme)
        elif isinstance(scheme, dict):
            found.extend(str(k) for k in scheme)
        for group in (node.get("config_groups") or {}).values() if isinstance(node.get("config_groups"), dict) else ():
            if isinstance(group, dict) and isinstance(group.get("weights"), dict):
                w, a = group["weights"], group.get("input_activations")
                kind = "FP" if w.get("type") == "float" else "W"
                found.append(f"{kind}{w.get('num_bits')}A{a.get('num_bits') if isinstance(a, dict) else 16}")
        for value in node.values():
            walk(value)

    walk(read_yaml(path))
    return found


def needs_data(recipe) -> list[str]:
    """Names of the recipe's modifiers that need calibration data (llm-compressor's requires_calibration_data)."""
    return [type(m).__name__ for m in recipe.modifiers if getattr(m, "requires_calibration_data", False)]


def check_calibration(
    build: str, recipe, recipe_path: Path, calibration: Calibration | None, at: str | None = None
) -> list[str]:
    """needs_data(recipe), once quantize.<build>.calibration suits the recipe (`recipe_path`, parsed by
    load_recipe): the quantize stage's rule, asked by validate too (`at`, "params.yaml:LINE", starts its messages).

    Raises QuantgateError when the recipe needs calibration data and the block has no calibration, or has a
    modifier that runs right only in the sequential pipeline (needs_sequential) and calibration.pipeline is not
    sequential."""
    prefix = f"{at}: " if at else ""
    if (needs := needs_data(recipe)) and calibration is None:
        raise QuantgateError(
            f"{prefix}quantize.{build}: {recipe_path} uses {', '.join(needs)}, which needs calibration data; add "
            "calibration: {samples: 256, seq_len: 512} to the block"
        )
    if (layerwise := needs_sequential(recipe)) and calibration and calibration.pipeline != "sequential":
        raise QuantgateError(
            f"{prefix}{recipe_path} (quantize.{build}.recipe): "
            + "; ".join(f"{name} {why}" for name, why in layerwise.items())
            + f"; set quantize.{build}.calibration.pipeline: sequential (it is {calibration.pipeline})"
        )
    return needs


# modifiers that run right only in llm-compressor's sequential calibration pipeline, and why (0.14.0.1):
SEQUENTIAL_ONLY = {
    # the basic pipeline hands it every module at once ("Only one decoding layer is expected")
    "AutoRoundModifier": "tunes one decoding layer at a time and runs only in the sequential pipeline",
    # the basic pipeline fires the epoch end, where AWQ grid-searches its scales, after it has turned quantization
    # back on and before QuantizationModifier has set any weight scale (llmcompressor/pipelines/basic/pipeline.py:
    # 60-75): the "16-bit" outputs AWQ fits to are fake-quantized with uninitialized scales, garbage that differs
    # run to run and may be NaN (then AWQ skips the layer). The sequential pipeline ends each layer inside
    # DisableQuantization (pipelines/sequential/pipeline.py:117-160).
    "AWQModifier": "fits its scales to the 16-bit outputs, which only the sequential pipeline computes with "
    "quantization off (the basic one fits them to outputs quantized with weight scales not yet set)",
}


def needs_sequential(recipe) -> dict[str, str]:
    """{modifier class name: why} for the recipe's modifiers that only run right with the sequential
    calibration pipeline (SEQUENTIAL_ONLY); empty if none."""
    return {
        type(m).__name__: SEQUENTIAL_ONLY[type(m).__name__]
        for m in recipe.modifiers
        if type(m).__name__ in SEQUENTIAL_ONLY
    }


def weight_schemes(recipe) -> list[tuple[object, list[str]]]:
    """(QuantizationScheme, ignore list) for every config group of the recipe's quantization modifiers."""
    out = []
    for m in recipe.modifiers:
        config = getattr(m, "resolved_config", None)
        if config is not None:
            out += [(s, list(getattr(m, "ignore", None) or [])) for s in config.config_groups.values()]
    return out


def check_group_size(
    model, group_size: int, ignore: list[str], where: str = "quantize.*.group_size", targets: list[str] | None = None
) -> None:
    """Raise QuantgateError unless `group_size` divides the input width of every Linear the config group
    quantizes: the modules its `targets` match (default ["Linear"]) minus `ignore`, matched by
    compressed-tensors' own rule (`match_named_modules`: class name, exact name or `re:` pattern), as
    llm-compressor applies the recipe.

    Names the first offending layer and lists the group sizes that would work (the powers of two from
    16 to 2048 that divide the gcd of the widths, as the W4A16 kernels expect).
    """
    import torch
    from compressed_tensors.utils.match import match_named_modules

    if group_size <= 0:
        raise QuantgateError(f"{where}: group_size {group_size} must be positive (e.g. 32, 64 or 128)")
    widths = {
        name: m.in_features
        for name, m in match_named_modules(model, targets or ["Linear"], ignore)
        if isinstance(m, torch.nn.Linear)
    }
    bad = [(name, w) for name, w in widths.items() if w % group_size]
    if bad:
        g = reduce(math.gcd, widths.values())
        ok = [2**k for k in range(4, 12) if g % 2**k == 0]
        fix = f"use one of {ok}" if ok else "no power-of-two group from 16 divides them all: use strategy channel"
        raise QuantgateError(
            f"{where}: group_size {group_size} does not divide the input width {bad[0][1]} of layer "
            f"{bad[0][0]} ({len(bad)} layers affected); {fix} (gcd of widths = {g})"
        )


def bits_per_weight(args, in_features: int) -> float:
    """Stored bits per weight of a layer of `in_features` inputs quantized at `args` (compressed-tensors'
    QuantizationArgs): the weight bits plus one 16-bit scale per group (per row for channel), plus a num_bits
    zero point per group when asymmetric. For example W4A16 at group size 64: 4 + 16/64 = 4.25."""
    per = args.group_size if args.strategy == "group" else in_features
    return args.num_bits + (16 + (0 if args.symmetric else args.num_bits)) / per


def least_bits_per_weight(args) -> float:
    """The fewest stored bits per weight a layer quantized at `args` can have, whatever its width: exactly
    bits_per_weight for group strategy (the group, not the layer, sets the scales' share); the weight bits
    alone otherwise (a channel's scale share shrinks as the layer widens). A bound on bits per weight below it
    leaves no build (the search's top_units refuses it once the model is loaded)."""
    if args.strategy == "group":
        return bits_per_weight(args, args.group_size)
    return float(args.num_bits)
