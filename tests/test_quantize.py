"""Quantize a tiny Llama built in the test with llm-compressor: real recipes, seconds."""

import json
import re

import pytest
from safetensors import safe_open

from pipeline.quantize import QuantizeParams, quantize
from quantgate.errors import QuantgateError
from quantgate.manifest import config_digest, read_manifest, verify_weights
from quantgate.serving import is_w4a16
from tests.tiny import tiny_llama_dir


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory.mktemp("fp16"))


def quant_config(out):
    return json.loads((out / "config.json").read_text())["quantization_config"]


def test_fp8_dynamic(src, tmp_path):
    out = tmp_path / "fp8"
    manifest = quantize("fp8", src, out, QuantizeParams(scheme="FP8_DYNAMIC"))
    qc = quant_config(out)
    group = next(iter(qc["config_groups"].values()))
    assert group["weights"]["type"] == "float" and group["weights"]["num_bits"] == 8
    assert group["input_activations"]["dynamic"] is True
    assert "lm_head" in qc["ignore"]
    assert manifest == read_manifest(out) and verify_weights(out)["build"] == "fp8"
    assert manifest["base_model"]["id"] == "tiny-llama"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert str(f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype) == "torch.float8_e4m3fn"


@pytest.mark.parametrize("algorithm", ["rtn", "gptq"])
def test_w4a16_groups(src, tmp_path, algorithm):
    out = tmp_path / algorithm
    quantize(
        "int4",
        src,
        out,
        QuantizeParams(
            scheme="W4A16", algorithm=algorithm, group_size=32, calibration_samples=4, calibration_seq_len=32
        ),
    )
    group = next(iter(quant_config(out)["config_groups"].values()))
    assert group["weights"] == {**group["weights"], "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        # packed int4: 8 values per int32, one scale per group of 32 inputs (64 -> 2 groups)
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_packed").shape == (64, 64 // 8)
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale").shape == (64, 2)
    assert "lm_head.weight_packed" not in keys


def test_group_size_not_dividing_width_is_refused_before_work(tmp_path):
    src = tiny_llama_dir(tmp_path / "src", hidden=96, intermediate=192)  # 96 is not a multiple of 64
    with pytest.raises(
        QuantgateError, match=r"group_size=64 does not divide the input width 96 of layer .*use one of \[16, 32\]"
    ):
        quantize("int4", src, tmp_path / "out", QuantizeParams(scheme="W4A16", group_size=64))
    assert not (tmp_path / "out").exists()


def test_unknown_or_repeated_param_is_refused_with_its_line(tmp_path):
    from quantgate.params import load_block

    params = tmp_path / "params.yaml"
    params.write_text("quantize:\n  int4:\n    scheme: W4A16\n    groupsize: 64\n")
    with pytest.raises(QuantgateError, match=r"params.yaml:4: quantize.int4.groupsize: Extra inputs are not permitted"):
        load_block("quantize.int4", QuantizeParams, params)
    params.write_text("quantize:\n  int4:\n    scheme: W4A16\n    group_size: 64\n    group_size: 128\n")
    with pytest.raises(
        QuantgateError, match=r"params.yaml:5: invalid YAML: duplicate key 'group_size' \(first on line 4\)"
    ):
        load_block("quantize.int4", QuantizeParams, params)
    for wrong in ("true", '"64"'):  # strict: no silent coercion to group_size 1 or 64
        params.write_text(f"quantize:\n  int4:\n    scheme: W4A16\n    group_size: {wrong}\n")
        with pytest.raises(
            QuantgateError, match=r"params.yaml:4: quantize.int4.group_size: Input should be a valid integer"
        ):
            load_block("quantize.int4", QuantizeParams, params)
    # a merge key is not a duplicate, and an explicit key overrides the merged one
    params.write_text("base: &b {scheme: W4A16, group_size: 64}\nquantize:\n  int4:\n    <<: *b\n    group_size: 128\n")
    assert load_block("quantize.int4", QuantizeParams, params).group_size == 128
    params.write_text("quantize:\n  int4:\n")  # a block left empty, or a scalar where a block goes
    with pytest.raises(
        QuantgateError,
        match=r"params.yaml:2: quantize.int4 must be a mapping of fields \(scheme, "
        r".*\); got nothing \(empty\)",
    ):
        load_block("quantize.int4", QuantizeParams, params)
    for text, got in (("", "nothing (empty)"), ("- quantize\n", "list ['quantize']")):  # the file itself
        params.write_text(text)
        with pytest.raises(
            QuantgateError,
            match=re.escape(f"params.yaml: must be a mapping of blocks (prepare, quantize, evaluate, ...); got {got}"),
        ):
            load_block("quantize.int4", QuantizeParams, params)
    params.write_text("quantize:\n  int4: 4\n")
    with pytest.raises(QuantgateError, match=r"params.yaml:2: quantize.int4 must be .*; got int 4"):
        load_block("quantize.int4", QuantizeParams, params)


def test_is_w4a16_recognises_the_builds_quantize_writes(src, tmp_path):
    quantize("fp8", src, tmp_path / "fp8", QuantizeParams(scheme="FP8_DYNAMIC"))
    quantize("int4", src, tmp_path / "int4", QuantizeParams(scheme="W4A16", algorithm="rtn", group_size=32))
    assert [is_w4a16(tmp_path / b) for b in ("fp8", "int4")] == [False, True]
    assert not is_w4a16(src) and not is_w4a16(tmp_path / "missing")


def test_config_digest_follows_config_and_tokenizer_not_weights_or_manifest(src, tmp_path):
    out = tmp_path / "fp8"
    quantize("fp8", src, out, QuantizeParams(scheme="FP8_DYNAMIC"))
    first = config_digest(out)
    (out / "build.json").write_text((out / "build.json").read_text() + "\n")
    assert config_digest(out) == first  # the manifest is about the build, not what the server computes
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "rope_theta": 1.0}))
    assert config_digest(out) != first  # the evaluation cache must not answer for a changed config
