"""The sweep's AWQ and AutoRound recipes (recipes/sweep/) quantize a tiny Llama on CPU, as the sweep calibrates them."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pipeline.quantize import Calibration, QuantizeParams, pinning_off_without_accelerator, quantize
from quantgate.errors import QuantgateError
from quantgate.manifest import read_manifest, verify_weights
from tests.tiny import tiny_llama_dir

REPO = Path(__file__).resolve().parents[1]
SWEEP = REPO / "recipes" / "sweep"
no_accelerator = pytest.mark.skipif(torch.accelerator.is_available(), reason="the CPU-only path")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    # hidden 64, intermediate 128: group 64 divides every Linear's input width, as 576 and 1536 do in SmolLM2
    return tiny_llama_dir(tmp_path_factory.mktemp("fp16"))


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    path = tmp_path_factory.mktemp("cal") / "calibration.jsonl"
    words = "user: explain this part of the python module\nassistant: the capital of france is paris and "
    rows = [{"source": "t", "text": words * (3 + i), "tokens": 64} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def assert_w4a16_g64(out: Path, recipe: Path, samples: int) -> dict:
    """The saved build is W4A16, group 64, symmetric, packed 8 values per int32, lm_head 16-bit, and its
    manifest records the recipe; returns the manifest."""
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = next(iter(qc["config_groups"].values()))["weights"]
    assert (weights["num_bits"], weights["type"], weights["symmetric"]) == (4, "int", True)
    assert (weights["strategy"], weights["group_size"]) == ("group", 64)
    assert "lm_head" in qc["ignore"]
    manifest = read_manifest(out)
    assert manifest["scheme"] == "W4A16" and verify_weights(out) == manifest
    assert manifest["recipe"]["file"] == str(recipe) and manifest["recipe"]["calibration"]["samples"] == samples
    assert len(manifest["recipe"]["calibration_sha256"]) == 64
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        # out x in/8 int32 words; one scale per group of 64 inputs: q_proj 64 inputs, down_proj 128
        assert f.get_tensor("model.layers.1.self_attn.q_proj.weight_packed").shape == (64, 8)
        assert str(f.get_tensor("model.layers.1.self_attn.q_proj.weight_packed").dtype) == "torch.int32"
        assert f.get_tensor("model.layers.1.self_attn.q_proj.weight_scale").shape == (64, 1)
        assert f.get_tensor("model.layers.1.self_attn.k_proj.weight_packed").shape == (32, 8)  # 2 KV heads x 16
        assert f.get_tensor("model.layers.1.mlp.down_proj.weight_packed").shape == (64, 16)
        assert f.get_tensor("model.layers.1.mlp.down_proj.weight_scale").shape == (64, 2)
    assert "lm_head.weight_packed" not in keys and "model.layers.1.mlp.down_proj.weight" not in keys
    # transformers loads the build back (compressed-tensors decompresses it) and it runs
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    logits = model(torch.tensor([[3, 4, 5, 9]])).logits
    assert logits.shape == (1, 4, 20) and bool(logits.isfinite().all())
    return manifest


def tensor(build: Path, name: str) -> torch.Tensor:
    with safe_open(str(build / "model.safetensors"), "pt") as f:
        return f.get_tensor(name).float()


@no_accelerator
def test_llm_compressor_pins_memory_which_cpu_torch_refuses_and_the_shim_skips_it():
    """The cause of "Cannot access accelerator device when none is available" in the AWQ sweep recipe: AWQ
    pins its cached inputs (IntermediatesCache.pin_memory) with no accelerator check. Inside the shim the call
    is a no-op that leaves the tensors as they were; after it llm-compressor's method is back."""
    from llmcompressor.pipelines.cache import IntermediatesCache

    original = IntermediatesCache.pin_memory
    cache = IntermediatesCache(None, None)
    cache.append({"hidden_states": torch.ones(2, 3)})
    with pytest.raises(RuntimeError, match="Cannot access accelerator device when none is available"):
        cache.pin_memory(0)
    with pinning_off_without_accelerator():
        cache.pin_memory(0)
        assert cache.fetch(0)["hidden_states"].sum().item() == 6.0
    assert IntermediatesCache.pin_memory is original


@pytest.mark.parametrize("native", [True, False], ids=["16-bit", "float32"])
@pytest.mark.parametrize("name", ["int4_awq_g64", "int4_awq_gptq_g64"])
def test_awq_recipes_quantize_on_cpu_the_same_weights_twice(src, tmp_path, calibration, monkeypatch, name, native):
    """In both work dtypes quantize calibrates in (16-bit where the CPU has it natively, float32 elsewhere):
    the basic pipeline fitted AWQ's scales to outputs quantized with uninitialized weight scales, so its
    builds differed run to run, and in bfloat16 the garbage was NaN and AWQ skipped every layer (CI on a
    16-bit-native CPU). The sequential pipeline makes the same weights twice."""
    monkeypatch.setattr("pipeline.quantize.native_16bit", lambda: native)
    recipe = SWEEP / f"{name}.yaml"
    c = Calibration(samples=4, seq_len=32, pipeline="sequential")  # the sweep's (benchmarks.quality.build_params)
    digests = []
    for run in ("a", "b"):
        out = tmp_path / run / name
        quantize(name, src, out, QuantizeParams(recipe=str(recipe), calibration=c), calibration_file=calibration)
        digests.append(assert_w4a16_g64(out, recipe, 4)["weights_digest"])
    assert digests[0] == digests[1]
    if name == "int4_awq_g64":  # the same recipe without AWQModifier: round-to-nearest alone, data-free
        rtn = tmp_path / "rtn.yaml"
        rtn.write_text(recipe.read_text().replace("    AWQModifier:\n      duo_scaling: true\n", ""))
        assert "AWQ" not in rtn.read_text().split("quant_stage:")[1]
        quantize("rtn", src, tmp_path / "rtn", QuantizeParams(recipe=str(rtn)))
        # AWQ moved per-channel scales into every mapping's balance layers: other group scales, all finite
        for layer in ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj"):
            weight = f"model.layers.0.{layer}.weight_scale"
            awq, plain = tensor(tmp_path / "a" / name, weight), tensor(tmp_path / "rtn", weight)
            assert awq.shape == plain.shape and bool(awq.isfinite().all()) and not torch.equal(awq, plain)


def test_autoround_recipe_quantizes_on_cpu_with_the_sequential_pipeline(src, tmp_path, calibration):
    recipe = SWEEP / "int4_autoround_g64.yaml"
    out = tmp_path / "autoround"
    c = Calibration(samples=4, seq_len=32, pipeline="sequential")
    quantize("autoround", src, out, QuantizeParams(recipe=str(recipe), calibration=c), calibration_file=calibration)
    manifest = assert_w4a16_g64(out, recipe, 4)
    assert manifest["recipe"]["calibration"]["pipeline"] == "sequential"
    # the packed 4-bit values times their group scales give back the 16-bit weights, within 4-bit error
    # (AutoRound's symmetric scales may be negative: the sign flips the integers, not the product)
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    for name in ("model.layers.0.mlp.up_proj", "model.layers.1.self_attn.o_proj"):
        w = tensor(src, f"{name}.weight")
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            q = unpack_from_int32(f.get_tensor(f"{name}.weight_packed"), 4, w.shape).float()
        assert q.min() >= -8 and q.max() <= 7
        scale = tensor(out, f"{name}.weight_scale")
        rebuilt = (q.reshape(w.shape[0], -1, 64) * scale.unsqueeze(-1)).reshape(w.shape)
        assert (rebuilt - w).norm() / w.norm() < 0.15


@pytest.mark.parametrize(
    "name, why",
    [
        (
            "int4_autoround_g64",
            "AutoRoundModifier tunes one decoding layer at a time and runs only in the sequential pipeline",
        ),
        (
            "int4_awq_g64",
            "AWQModifier fits its scales to the 16-bit outputs, which only the sequential pipeline "
            "computes with quantization off (the basic one fits them to outputs quantized with weight scales not yet "
            "set)",
        ),
    ],
)
def test_a_sequential_only_recipe_in_the_basic_pipeline_is_one_line_naming_the_recipe_before_work(
    src, tmp_path, calibration, name, why
):
    recipe = SWEEP / f"{name}.yaml"
    c = Calibration(samples=4, seq_len=32, pipeline="basic")
    with pytest.raises(QuantgateError) as err:
        quantize("int4", src, tmp_path / "out", QuantizeParams(recipe=str(recipe), calibration=c), calibration)
    assert str(err.value) == (
        f"{recipe} (quantize.int4.recipe): {why}; set quantize.int4.calibration.pipeline: sequential (it is basic)"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "name, setting, bad, message",
    [
        ("int4_autoround_g64", "iters: 20", "iters: many", "AutoRoundModifier.iters: Input should be a valid integer"),
        (
            "int4_awq_g64",
            "duo_scaling: true",
            "duo_scaling: sometimes",
            "AWQModifier.duo_scaling.bool: Input should be a valid boolean, unable to interpret input "
            "(got 'sometimes')",
        ),
        ("int4_autoround_g64", "group_size: 64", "group_size: 48", "group_size 48 does not divide the input width 64"),
    ],
)
def test_a_bad_setting_in_a_sweep_recipe_is_one_line_naming_the_file(
    src, tmp_path, calibration, name, setting, bad, message
):
    text = (SWEEP / f"{name}.yaml").read_text()
    assert setting in text
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(text.replace(setting, bad))
    c = Calibration(samples=4, seq_len=32, pipeline="sequential")
    with pytest.raises(QuantgateError) as err:
        quantize("int4", src, tmp_path / "out", QuantizeParams(recipe=str(recipe), calibration=c), calibration)
    assert str(err.value).startswith(f"{recipe} (quantize.int4.recipe): ") and message in str(err.value)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


def test_the_sweep_calibrates_autoround_and_awq_sequentially_and_the_rest_as_int4(monkeypatch):
    from benchmarks.quality import build_params
    from quantgate.params import load_block

    monkeypatch.chdir(REPO)  # params.yaml
    int4 = load_block("quantize.int4", QuantizeParams).calibration
    builds = build_params(["int4_autoround_g64", "int4_awq_g64", "int4_awq_gptq_g64"])
    sequential = int4.model_copy(update={"pipeline": "sequential"})
    assert int4.pipeline == "basic"
    assert builds["int4_autoround_g64"].calibration == builds["int4_awq_g64"].calibration == sequential
    assert builds["int4_awq_gptq_g64"].calibration == sequential
    assert builds["int4_autoround_g64"].recipe == "recipes/sweep/int4_autoround_g64.yaml"
