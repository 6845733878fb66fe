"""Quantize a tiny Llama built in the test with llm-compressor: the repo's real recipes and bad ones, seconds."""

import json
import re
from pathlib import Path

import pytest
from safetensors import safe_open

from pipeline.quantize import Calibration, QuantizeParams, quantize, scheme_label
from quantgate.errors import QuantgateError
from quantgate.manifest import config_digest, read_manifest, verify_weights
from quantgate.recipes import check_group_size, load_recipe
from quantgate.serving import is_w4a16
from tests.tiny import tiny_llama_dir

REPO = Path(__file__).resolve().parents[1]
W4_G32 = """quant_stage:
  quant_modifiers:
    {modifier}:
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: [Linear]
          weights: {{num_bits: 4, type: int, symmetric: true, strategy: group, group_size: {group}}}
"""


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory.mktemp("fp16"))


@pytest.fixture
def calibration(tmp_path):
    path = tmp_path / "calibration.jsonl"
    text = "user: explain this part of the python module\nassistant: the capital of france is paris " * 4
    path.write_text("".join(json.dumps({"source": "t", "text": text, "tokens": 64}) + "\n" for _ in range(8)))
    return path


def recipe_file(tmp_path, text, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def quant_config(out):
    return json.loads((out / "config.json").read_text())["quantization_config"]


def test_fp8_dynamic_from_the_repo_recipe(src, tmp_path):
    out = tmp_path / "fp8"
    manifest = quantize("fp8", src, out, QuantizeParams(recipe=str(REPO / "recipes/fp8.yaml")))
    qc = quant_config(out)
    group = next(iter(qc["config_groups"].values()))
    assert group["weights"]["type"] == "float" and group["weights"]["num_bits"] == 8
    assert group["input_activations"]["dynamic"] is True
    assert "lm_head" in qc["ignore"]
    assert manifest == read_manifest(out) and verify_weights(out)["build"] == "fp8"
    assert manifest["base_model"]["id"] == "tiny-llama" and manifest["scheme"] == "FP8_DYNAMIC"
    # lineage: the recipe file and its digest
    assert manifest["recipe"]["file"].endswith("recipes/fp8.yaml") and len(manifest["recipe"]["sha256"]) == 64
    assert manifest["recipe"]["calibration"] is None
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert str(f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype) == "torch.float8_e4m3fn"


def test_int8_smoothquant_gptq_from_the_repo_recipe_uses_the_calibration(src, tmp_path, calibration):
    out = tmp_path / "int8"
    c = Calibration(samples=4, seq_len=32, pipeline="sequential")
    manifest = quantize(
        "int8",
        src,
        out,
        QuantizeParams(recipe=str(REPO / "recipes/int8.yaml"), calibration=c),
        calibration_file=calibration,
    )
    group = next(iter(quant_config(out)["config_groups"].values()))
    assert group["weights"]["num_bits"] == 8 and group["weights"]["type"] == "int"
    assert group["input_activations"]["num_bits"] == 8 and group["input_activations"]["dynamic"] is True
    assert manifest["scheme"] == "W8A8" and manifest["recipe"]["calibration"]["samples"] == 4
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert str(f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype) == "torch.int8"
        # calibrated in float32 on CPUs without native bf16, saved at the 16-bit build's dtype
        assert str(f.get_tensor("model.embed_tokens.weight").dtype) == "torch.bfloat16"
        assert str(f.get_tensor("model.layers.0.mlp.up_proj.weight_scale").dtype) == "torch.bfloat16"


@pytest.mark.parametrize("modifier", ["QuantizationModifier", "GPTQModifier"])
def test_w4a16_groups(src, tmp_path, calibration, modifier):
    out = tmp_path / modifier
    recipe = recipe_file(tmp_path, W4_G32.format(modifier=modifier, group=32))
    c = Calibration(samples=4, seq_len=32, pipeline="basic")
    quantize("int4", src, out, QuantizeParams(recipe=recipe, calibration=c), calibration_file=calibration)
    group = next(iter(quant_config(out)["config_groups"].values()))
    assert group["weights"] == {**group["weights"], "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}
    assert read_manifest(out)["scheme"] == "W4A16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        # packed int4: 8 values per int32, one scale per group of 32 inputs (64 -> 2 groups)
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_packed").shape == (64, 64 // 8)
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale").shape == (64, 2)
    assert "lm_head.weight_packed" not in keys


def test_group_size_not_dividing_width_is_refused_before_work(tmp_path):
    src = tiny_llama_dir(tmp_path / "src", hidden=96, intermediate=192)  # 96 is not a multiple of 64
    recipe = recipe_file(tmp_path, W4_G32.format(modifier="QuantizationModifier", group=64))
    with pytest.raises(
        QuantgateError,
        match=r"recipe.yaml \(quantize.int4.recipe\): group_size 64 does not divide the input width 96 of layer "
        r".*use one of \[16, 32\]",
    ):
        quantize("int4", src, tmp_path / "out", QuantizeParams(recipe=recipe))
    assert not (tmp_path / "out").exists()


def test_group_size_check_follows_the_recipe_targets(tmp_path):
    """Only the Linears a config group targets must be divisible: down_proj (input 192) is checked when the
    group targets every Linear, and not when it targets the attention projections alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir(tmp_path / "m", hidden=64, intermediate=96))
    with pytest.raises(QuantgateError, match=r"group_size 64 does not divide the input width 96 of layer .*down_proj"):
        check_group_size(model, 64, ["lm_head"], "recipe.yaml", ["Linear"])
    check_group_size(model, 64, ["lm_head"], "recipe.yaml", ["re:.*self_attn.*"])  # no error: 64 divides 64
    check_group_size(model, 64, ["lm_head", "re:.*down_proj$"], "recipe.yaml", ["Linear"])
    with pytest.raises(QuantgateError, match=r"recipe.yaml: group_size 0 must be positive"):
        check_group_size(model, 0, ["lm_head"], "recipe.yaml")
    odd = AutoModelForCausalLM.from_pretrained(tiny_llama_dir(tmp_path / "odd", hidden=72, intermediate=100))
    with pytest.raises(QuantgateError, match=r"no power-of-two group from 16 divides them all: use strategy channel"):
        check_group_size(odd, 16, ["lm_head"], "recipe.yaml")


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "quant_stage:\n  quant_modifiers:\n    GPTQModifer: {scheme: W4A16}\n",
            "llm-compressor rejects this recipe: No modifier of type 'GPTQModifer' found.",
        ),
        (
            "quant_stage:\n  quant_modifiers:\n    GPTQModifier: {scheme: W4A16, dampening_frac: lots}\n",
            "GPTQModifier.dampening_frac: Input should be a valid number, unable to parse string as a number "
            "(got 'lots')",
        ),
        ("quant_stage: [\n", "invalid YAML: expected the node content"),
        ("- GPTQModifier\n", "a recipe is a mapping `quant_stage: quant_modifiers:"),
        ("quant_stage: {}\n", "no modifiers; a recipe reads `quant_stage: quant_modifiers:"),
    ],
)
def test_bad_recipe_is_one_line_naming_the_file(tmp_path, text, message):
    path = Path(recipe_file(tmp_path, text))
    with pytest.raises(QuantgateError) as err:
        load_recipe("int4", path)
    assert str(err.value).startswith(str(path)) and message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_recipe_or_calibration_is_refused_before_the_model_loads(src, tmp_path):
    with pytest.raises(QuantgateError, match=r"nope.yaml \(quantize.int4.recipe\): recipe file not found"):
        quantize("int4", src, tmp_path / "out", QuantizeParams(recipe=str(tmp_path / "nope.yaml")))
    with pytest.raises(
        QuantgateError,
        match=r"quantize.int8: .*int8.yaml uses SmoothQuantModifier, GPTQModifier, which needs calibration",
    ):
        quantize("int8", src, tmp_path / "out", QuantizeParams(recipe=str(REPO / "recipes/int8.yaml")))
    c = Calibration(samples=4, seq_len=32)

    def int8_from(calibration_file):
        quantize(
            "int8",
            src,
            tmp_path / "out",
            QuantizeParams(recipe=str(REPO / "recipes/int8.yaml"), calibration=c),
            calibration_file=calibration_file,
        )

    with pytest.raises(QuantgateError, match=r"missing.jsonl: no calibration conversations; run the calibrate stage"):
        int8_from(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    shape = r"expected \{\"text\": \"<conversation>\", ...\}"
    for line, problem in (
        ('{"source": "x", "text": "broken', r"invalid JSON \(Unterminated string starting at column 25\)"),
        ('{"source": "x"}', shape),
        ('{"text": 5}', shape),
        ("[]", shape),
    ):
        bad.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
        with pytest.raises(QuantgateError, match=rf"bad.jsonl:2: {problem}; re-run the calibrate stage \(`dvc repro"):
            int8_from(bad)
    assert not (tmp_path / "out").exists()


def test_scheme_label_names_the_scheme_in_the_fields_terms():
    def cfg(w, a=None):
        return {"quantization_config": {"config_groups": {"g": {"weights": w, "input_activations": a}}}}

    assert scheme_label(cfg({"num_bits": 4, "type": "int"})) == "W4A16"
    assert scheme_label(cfg({"num_bits": 8, "type": "int"}, {"num_bits": 8, "type": "int"})) == "W8A8"
    assert scheme_label(cfg({"num_bits": 8, "type": "float"}, {"num_bits": 8, "type": "float", "dynamic": True})) == (
        "FP8_DYNAMIC"
    )


def test_unknown_or_repeated_param_is_refused_with_its_line(tmp_path):
    from quantgate.params import load_block

    params = tmp_path / "params.yaml"
    params.write_text("quantize:\n  int4:\n    recipe: recipes/int4.yaml\n    groupsize: 64\n")
    with pytest.raises(QuantgateError, match=r"params.yaml:4: quantize.int4.groupsize: unknown key \(the keys"):
        load_block("quantize.int4", QuantizeParams, params)
    params.write_text("quantize:\n  int4:\n    recipe: a.yaml\n    recipe: b.yaml\n")
    with pytest.raises(
        QuantgateError, match=r"params.yaml:4: invalid YAML: duplicate key 'recipe' \(first on line 3\)"
    ):
        load_block("quantize.int4", QuantizeParams, params)
    for wrong in ("true", '"64"'):  # strict: no silent coercion
        params.write_text(f"quantize:\n  int4:\n    recipe: r.yaml\n    calibration: {{samples: {wrong}}}\n")
        with pytest.raises(
            QuantgateError, match=r"params.yaml:4: quantize.int4.calibration.samples: Input should be a valid integer"
        ):
            load_block("quantize.int4", QuantizeParams, params)
    # a merge key is not a duplicate, and an explicit key overrides the merged one
    params.write_text("base: &b {recipe: a.yaml}\nquantize:\n  int4:\n    <<: *b\n    recipe: b.yaml\n")
    assert load_block("quantize.int4", QuantizeParams, params).recipe == "b.yaml"
    params.write_text("quantize:\n  int4:\n")  # a block left empty, or a scalar where a block goes
    with pytest.raises(
        QuantgateError,
        match=r"params.yaml:2: quantize.int4 must be a mapping of fields \(recipe, "
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
    quantize("fp8", src, tmp_path / "fp8", QuantizeParams(recipe=str(REPO / "recipes/fp8.yaml")))
    recipe = recipe_file(tmp_path, W4_G32.format(modifier="QuantizationModifier", group=32))
    quantize("int4", src, tmp_path / "int4", QuantizeParams(recipe=recipe))
    assert [is_w4a16(tmp_path / b) for b in ("fp8", "int4")] == [False, True]
    assert not is_w4a16(src) and not is_w4a16(tmp_path / "missing")


def test_config_digest_follows_config_and_tokenizer_not_weights_or_manifest(src, tmp_path):
    out = tmp_path / "fp8"
    quantize("fp8", src, out, QuantizeParams(recipe=str(REPO / "recipes/fp8.yaml")))
    first = config_digest(out)
    (out / "build.json").write_text((out / "build.json").read_text() + "\n")
    assert config_digest(out) == first  # the manifest is about the build, not what the server computes
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "rope_theta": 1.0}))
    assert config_digest(out) != first  # the evaluation cache must not answer for a changed config


def test_a_build_with_another_builds_recipe_copies_its_weights_instead_of_quantizing(
    src, tmp_path, calibration, capsys
):
    # int4-mixed after a search that kept no layer 16-bit: int4's recipe, written out again by the search
    models = tmp_path / "models"
    c = Calibration(samples=4, seq_len=32, pipeline="basic")
    text = W4_G32.format(modifier="GPTQModifier", group=32)
    int4 = quantize(
        "int4",
        src,
        models / "int4",
        QuantizeParams(recipe=recipe_file(tmp_path, text), calibration=c),
        calibration_file=calibration,
    )
    relaid = "# the search's copy\n" + text.replace("ignore: [lm_head]", "ignore:\n      - lm_head")
    mixed_params = QuantizeParams(recipe=recipe_file(tmp_path, relaid, "mixed.yaml"), calibration=c)
    capsys.readouterr()
    mixed = quantize("int4-mixed", src, models / "int4-mixed", mixed_params, calibration_file=calibration)
    out = capsys.readouterr().out
    assert f"quantize[int4-mixed]: {models / 'int4'} was made from the same recipe" in out
    assert "smoke answer" not in out  # nothing was quantized
    assert mixed["weights_digest"] == int4["weights_digest"] and mixed["build"] == "int4-mixed"
    assert mixed["recipe"]["file"].endswith("mixed.yaml") and mixed["recipe"]["sha256"] != int4["recipe"]["sha256"]
    assert verify_weights(models / "int4-mixed")["build"] == "int4-mixed"


def test_other_calibration_data_or_weights_changed_since_are_quantized_again(src, tmp_path, calibration, capsys):
    models = tmp_path / "models"
    c = Calibration(samples=4, seq_len=32, pipeline="basic")
    params = QuantizeParams(
        recipe=recipe_file(tmp_path, W4_G32.format(modifier="GPTQModifier", group=32)), calibration=c
    )
    quantize("int4", src, models / "int4", params, calibration_file=calibration)
    other = tmp_path / "other.jsonl"
    other.write_text(calibration.read_text().replace("paris", "lyon"))
    capsys.readouterr()
    again = quantize("int4-mixed", src, models / "int4-mixed", params, calibration_file=other)
    assert (
        "same recipe" not in capsys.readouterr().out
        and again["recipe"]["calibration_sha256"] != read_manifest(models / "int4")["recipe"]["calibration_sha256"]
    )
    # a twin whose weights changed after it was made is not copied
    weights = models / "int4" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    quantize("int4-mixed", src, models / "int4-mixed", params, calibration_file=calibration)
    assert "same recipe" not in capsys.readouterr().out


def test_the_same_recipe_and_calibration_make_the_same_weights_twice(src, tmp_path, calibration):
    # SmoothQuant + GPTQ W8A8 from the same calibration file: one commit, one build (sha256 of the weights)
    c = Calibration(samples=4, seq_len=32, pipeline="basic")
    params = QuantizeParams(recipe=str(REPO / "recipes/int8.yaml"), calibration=c)
    digests = [
        quantize("int8", src, tmp_path / run / "int8", params, calibration_file=calibration)["weights_digest"]
        for run in ("a", "b")
    ]
    assert digests[0] == digests[1]


def test_a_folder_named_otherwise_than_its_build_is_made_again_not_copied_onto_itself(src, tmp_path, calibration):
    c = Calibration(samples=4, seq_len=32, pipeline="basic")
    params = QuantizeParams(
        recipe=recipe_file(tmp_path, W4_G32.format(modifier="GPTQModifier", group=32)), calibration=c
    )
    first = quantize("int4", src, tmp_path / "builds" / "candidate", params, calibration_file=calibration)
    again = quantize("int4", src, tmp_path / "builds" / "candidate", params, calibration_file=calibration)
    assert again["weights_digest"] == first["weights_digest"] and verify_weights(tmp_path / "builds" / "candidate")


def test_a_w4a8_build_is_int4s_weights_recorded_as_served_w4a8(src, tmp_path, calibration, capsys):
    # quantize.int4-w4a8: {recipe: <int4's>, w4a8: true}: the same weights (copied, not quantized again), with
    # build.json saying how every server of it runs them; evaluate's and profile's caches tell the two apart
    models = tmp_path / "models"
    c = Calibration(samples=4, seq_len=32, pipeline="basic")
    recipe = recipe_file(tmp_path, W4_G32.format(modifier="GPTQModifier", group=32))
    int4 = quantize("int4", src, models / "int4", QuantizeParams(recipe=recipe, calibration=c), calibration)
    capsys.readouterr()
    w4a8 = quantize(
        "int4-w4a8", src, models / "int4-w4a8", QuantizeParams(recipe=recipe, calibration=c, w4a8=True), calibration
    )
    assert "its weights are copied, not quantized again" in capsys.readouterr().out
    assert w4a8["weights_digest"] == int4["weights_digest"]
    assert (w4a8["scheme"], w4a8["w4a8"]) == ("W4A8", True) and "w4a8" not in int4 and int4["scheme"] == "W4A16"
    assert read_manifest(models / "int4-w4a8") == w4a8
    from quantgate.serving import serves_w4a8

    assert serves_w4a8(models / "int4-w4a8") and not serves_w4a8(models / "int4")


@pytest.mark.parametrize("recipe", ["recipes/int8.yaml", "recipes/fp8.yaml"])
def test_w4a8_on_a_recipe_that_is_not_w4a16_is_refused_before_the_model_loads(src, tmp_path, recipe):
    c = Calibration(samples=4, seq_len=32)
    with pytest.raises(
        QuantgateError,
        match=rf"quantize.int8-w4a8.w4a8: true needs a W4A16 recipe .* and .*{recipe} makes "
        r".* weights with 8-bit \w+ activations; give",
    ):
        quantize(
            "int8-w4a8", src, tmp_path / "out", QuantizeParams(recipe=str(REPO / recipe), calibration=c, w4a8=True)
        )
    assert not (tmp_path / "out").exists()
