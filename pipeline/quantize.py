"""Stage `quantize@<build>`: one quantized build, made by llm-compressor `oneshot` from a recipe YAML.

Run by DVC: `python -m pipeline.quantize BUILD SRC_DIR OUT_DIR` (params block `quantize.<BUILD>`).

The recipe is a file under recipes/ in llm-compressor's own format (`<name>_stage: <group>_modifiers:
<Modifier>: {args}`), checked with llm-compressor's parser before the model loads. Recipes whose
modifiers need data (GPTQ, AWQ, SmoothQuant, imatrix observers) get the calibration stage's
conversations (results/calibration.jsonl). Output: compressed-tensors safetensors that vLLM loads
unchanged, plus build.json, whose recipe record holds the recipe file's sha256 (the build's lineage).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from quantgate.console import log_progress, per_build
from quantgate.conversations import CALIBRATION_FILE, Calibration, calibration_texts
from quantgate.devices import visible_devices
from quantgate.errors import QuantgateError, run_main
from quantgate.hashing import digest_json, sha256_file
from quantgate.manifest import MANIFEST, read_manifest, verify_weights, write_manifest
from quantgate.params import PARAMS_FILE, load_block, read_yaml, where
from quantgate.precision import native_16bit
from quantgate.quantize_params import QuantizeParams
from quantgate.recipes import check_calibration, check_group_size, load_recipe, weight_schemes


def scheme_label(config: dict) -> str:
    """The build's scheme in the field's terms, from its saved quantization_config (config.json):
    W4A16, W8A8, FP8_DYNAMIC, FP8, or W<bits>A<bits> otherwise; the first config group decides."""
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    group = next(iter(groups.values()), {})
    w, a = group.get("weights") or {}, group.get("input_activations") or {}
    if w.get("type") == "float" and w.get("num_bits") == 8 and a.get("type") == "float":
        return "FP8_DYNAMIC" if a.get("dynamic") else "FP8"
    return f"W{w.get('num_bits', 16)}A{a.get('num_bits', 16) if a else 16}"


def calibration_dataset(tokenizer, c: Calibration, path: Path = CALIBRATION_FILE):
    """The first `c.samples` calibration conversations of `path`, tokenized (datasets.Dataset with
    input_ids/attention_mask, at most `c.seq_len` tokens each).

    Raises QuantgateError if the file is missing or holds fewer conversations than asked for.
    """
    from datasets import Dataset

    texts = calibration_texts(path, c.samples, "quantize.*.calibration.samples")
    return Dataset.from_dict({"text": texts}).map(
        lambda s: tokenizer(s["text"], max_length=c.seq_len, truncation=True, add_special_tokens=False),
        remove_columns=["text"],
    )


@contextmanager
def pinning_off_without_accelerator():
    """While llm-compressor runs on a machine without an accelerator, make its IntermediatesCache.pin_memory a
    no-op; with an accelerator (or an llm-compressor without that method) change nothing.

    Why: AWQModifier._apply_smoothing (llmcompressor/modifiers/transform/awq/base.py:505-507, 0.14.0.1) pins its
    cached parent-module inputs before each grid search, and IntermediatesCache._pin_intermediate
    (pipelines/cache.py:154-155) calls Tensor.pin_memory() on every CPU tensor, with no accelerator check (the
    check went when pinning moved out of _offload_value, llm-compressor PR #2813). CPU-only torch raises
    "Cannot access accelerator device when none is available" there. Pinned memory only speeds copies to a
    device; with no device there is no copy, so skipping it changes no value. No recipe setting avoids the
    call: offload_device only chooses where the cached inputs live (the CPU here either way), and both
    pipelines reach _apply_smoothing.
    """
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    pin = getattr(IntermediatesCache, "pin_memory", None)
    if pin is None or torch.accelerator.is_available():
        yield
        return
    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = pin


def recipe_record(
    p: QuantizeParams, recipe_path: Path, source_digest: str, calibration_file: Path | None = None
) -> dict:
    """The `recipe` of a build's manifest (build.json): the recipe file and its sha256, the sha256 of its
    parsed content (comments and layout aside), the calibration and the sha256 of the calibration data
    file it read (`calibration_file`, None for a data-free recipe), and the sha256 digest of the 16-bit
    weights it was made from. Equal records = the same build recipe (`same_recipe`)."""
    return {
        "file": p.recipe,
        "sha256": sha256_file(recipe_path),
        "content_sha256": digest_json(read_yaml(recipe_path)),
        "calibration": p.calibration.model_dump() if p.calibration else None,
        "calibration_sha256": sha256_file(calibration_file) if calibration_file else None,
        "source_weights_sha256": source_digest,
    }


def same_recipe(a: dict, b: dict) -> bool:
    """True if two manifests' recipe records make the same weights: the same recipe content, calibration
    settings and data, and source weights, whatever the recipe files are called or how they are laid out."""
    keys = ("content_sha256", "calibration", "calibration_sha256", "source_weights_sha256")
    return all(k in a for k in keys) and all(a.get(k) == b.get(k) for k in keys)


def twin_build(out: Path, record: dict) -> Path | None:
    """Another build directory beside `out` (the build being made) whose build.json records the same recipe
    (`same_recipe`) and whose weights still match it, or None. When the mixed-precision search keeps no
    layer 16-bit, int4-mixed's recipe is int4's: re-quantizing would cost minutes for the same weights."""
    for manifest_file in sorted(out.parent.glob(f"*/{MANIFEST}")):
        twin = manifest_file.parent
        if twin.resolve() == out.resolve():  # its own earlier make, about to be replaced
            continue
        try:
            if same_recipe(read_manifest(twin).get("recipe") or {}, record):
                verify_weights(twin)
                return twin
        except QuantgateError:  # unreadable or changed since: not a twin
            continue
    return None


def quantize(build: str, src: Path, out: Path, p: QuantizeParams, calibration_file: Path = CALIBRATION_FILE) -> dict:
    """Quantize the build in `src` into `out` with the recipe of `p`; return the new manifest.

    Calibrated recipes read their conversations from `calibration_file` (the calibrate stage's out).

    Raises QuantgateError (before the model is quantized) for a bad recipe, a recipe that needs
    calibration without a `calibration` block, or a group size that does not divide a layer.
    """
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.smoke import smoke_generate

    recipe_path = Path(p.recipe)
    recipe = load_recipe(build, recipe_path)
    needs = check_calibration(build, recipe, recipe_path, p.calibration)
    if p.w4a8:
        check_w4a16(build, recipe_path, recipe)
    base = read_manifest(src)
    if needs:  # a missing or malformed calibration file is refused before it is hashed
        calibration_texts(calibration_file, p.calibration.samples, "quantize.*.calibration.samples")
    record = recipe_record(p, recipe_path, base["weights_digest"], calibration_file if needs else None)
    if (twin := twin_build(out, record)) is not None:
        print(
            f"quantize[{build}]: {twin} was made from the same recipe, calibration and source weights; "
            "its weights are copied, not quantized again",
            flush=True,
        )
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(twin, out, ignore=shutil.ignore_patterns(MANIFEST))
        return save_manifest(build, out, base, record, p)
    dtype = getattr(torch, base["dtype"])  # the 16-bit build's dtype, which the saved build keeps
    # calibrate in float32 where 16-bit arithmetic is emulated; the build is cast back before it is saved
    work_dtype = dtype if native_16bit() else torch.float32
    model = AutoModelForCausalLM.from_pretrained(src, dtype=work_dtype)
    if torch.cuda.is_available() and not (p.calibration and p.calibration.pipeline == "sequential"):
        model.to("cuda")  # `basic` and data-free recipes run where the model is; `sequential` onloads layer by layer
    tokenizer = AutoTokenizer.from_pretrained(src)
    # validate before spending minutes on calibration
    for scheme, ignore in weight_schemes(recipe):
        if scheme.weights is not None and scheme.weights.group_size:
            check_group_size(
                model, scheme.weights.group_size, ignore, f"{recipe_path} (quantize.{build}.recipe)", scheme.targets
            )
    started = time.monotonic()
    if needs:
        c = p.calibration
        data = calibration_dataset(tokenizer, c, calibration_file)
        with pinning_off_without_accelerator():
            oneshot(
                model=model,
                recipe=str(recipe_path),
                dataset=data,
                max_seq_length=c.seq_len,
                num_calibration_samples=c.samples,
                pipeline=c.pipeline,
                shuffle_calibration_samples=False,  # llm-compressor's shuffle is unseeded: builds would differ
            )
    else:
        oneshot(model=model, recipe=str(recipe_path))
    print(f"quantize[{build}]: {recipe_path} in {time.monotonic() - started:.1f} s", flush=True)
    # smoke generation: a broken build shows here first
    print(f"quantize[{build}]: smoke answer: {smoke_generate(model, tokenizer)!r}", flush=True)
    # save compressed-tensors
    shutil.rmtree(out, ignore_errors=True)
    model.to(dtype)  # floating-point tensors only: integer zero points and packed weights keep their type
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    return save_manifest(build, out, base, record, p)


def check_w4a16(build: str, recipe_path: Path, recipe) -> None:
    """Raise QuantgateError unless every config group of `recipe` is W4A16 (4-bit integer weights, no
    activation quantization): the only weights vLLM CPU serves as W4A8 (quantize.<build>.w4a8)."""
    schemes = [s for s, _ in weight_schemes(recipe)]
    bad = [
        s
        for s in schemes
        if s.input_activations is not None or s.weights is None or (s.weights.num_bits, s.weights.type) != (4, "int")
    ]
    if bad or not schemes:
        w, a = (bad[0].weights, bad[0].input_activations) if bad else (None, None)
        makes = (
            "quantizes nothing"
            if not schemes
            else f"makes {(w.type if w else 'no').upper()}{w.num_bits if w else ''} weights with "
            + (f"{a.num_bits}-bit {a.type} activations" if a else "16-bit activations")
        )
        raise QuantgateError(
            f"{where(PARAMS_FILE, f'quantize.{build}.w4a8')}: quantize.{build}.w4a8: true needs a W4A16 recipe (4-bit "
            f"integer weights, 16-bit activations), and {recipe_path} {makes}; give the block a W4A16 recipe such as "
            "recipes/int4.yaml (the int8 activations come from vLLM at serving, not from the recipe), or drop w4a8"
        )


def save_manifest(build: str, out: Path, base: dict, record: dict, p: QuantizeParams) -> dict:
    """Write build.json of the build in `out` (scheme read from its config.json, lineage from the 16-bit
    build's manifest `base` and the recipe `record`) and return it. How every vLLM server of the build runs
    it is recorded there too: p.kv_cache_dtype when not "auto", and w4a8: true when p.w4a8 (its scheme is then
    W4A8, what vLLM serves, though config.json holds W4A16 weights)."""
    scheme = "W4A8" if p.w4a8 else scheme_label(json.loads((out / "config.json").read_text()))  # what is served
    manifest = write_manifest(
        out, build=build, scheme=scheme, dtype=base["dtype"], base_model=base["base_model"], recipe=record
    )
    settings = {"kv_cache_dtype": p.kv_cache_dtype} if p.kv_cache_dtype != "auto" else {}
    settings |= {"w4a8": True} if p.w4a8 else {}
    if settings:
        manifest |= settings
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main() -> None:
    if len(sys.argv) != 4:
        raise QuantgateError("usage: python -m pipeline.quantize BUILD SRC_DIR OUT_DIR")
    build, src, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    params = load_block(f"quantize.{build}", QuantizeParams)
    if (cuda := visible_devices(params.devices, f"quantize.{build}.devices")) is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda  # before torch is imported
    with log_progress(r"Quantizing (\d+) module", desc=f"quantize[{build}]: GPTQ", unit="module"):
        manifest = quantize(build, src, out, params)
    print(f"quantize[{build}]: wrote {out}, {manifest['scheme']} (digest {manifest['weights_digest'][:12]})")


if __name__ == "__main__":
    run_main(main, log=per_build("quantize"))
