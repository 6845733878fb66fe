"""validate reads params.yaml as the stages will, before any of them runs (pipeline/validate.py): the search
block's pairing with the quantize blocks and builds, every quantize block's keys and recipe file, calibration
counts against the calibrate stage's file, and the search's document budget against one look at every team.
Each case is a one-line QuantgateError naming params.yaml (and the line, where the parse found one) and the key."""

import re
import shutil
from pathlib import Path

import pytest
import yaml

from pipeline.validate import (
    check_calibrate,
    check_calibration_supply,
    check_context_length,
    check_doc_budget,
    check_evaluate,
    check_later_blocks,
    check_prepare,
    check_quantize,
    check_samples,
    check_search,
    check_serving_python,
)
from quantgate.errors import QuantgateError
from quantgate.params import load_builds, read_yaml
from quantgate.teams import load_teams
from tests.conftest import checkout_view

REPO = Path(__file__).resolve().parents[1]
BUILDS = ["fp16", "fp8", "int8", "int4", "int4-mixed"]


@pytest.fixture
def params(tmp_path, monkeypatch):
    """edit(change) writes the repo's params.yaml, with change(doc) applied, to a folder holding the repo's
    recipes (relative paths resolve as under `dvc repro`), and returns its path."""
    shutil.copytree(REPO / "recipes", tmp_path / "recipes")
    monkeypatch.chdir(tmp_path)

    def edit(change=lambda doc: None) -> Path:
        doc = read_yaml(REPO / "params.yaml")
        change(doc)
        path = tmp_path / "params.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    return edit


def one_line_error(call, match: str) -> str:
    with pytest.raises(QuantgateError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message.strip() and re.search(match, message), message
    return message


def test_the_repos_params_pass_every_check(params):
    path = params()
    builds = load_builds(path)
    search = check_search(builds, path)
    blocks = check_quantize(builds, path)
    check_samples(search, blocks, check_calibrate(path), path)
    check_doc_budget(search, load_teams(REPO / "evals"), builds, path)
    assert check_evaluate(builds, path).serve.max_slowdown == 3.0
    check_later_blocks(check_evaluate(BUILDS, path), path)
    assert builds == BUILDS and set(blocks) == set(BUILDS) - {"fp16"} and search.base == "int4"
    assert check_prepare(path).source == "builtin"


@pytest.mark.parametrize(
    "prepare, message",
    [
        ({"dtype": "bf16"}, r"params.yaml:\d+: prepare.dtype: Input should be 'bfloat16' or 'float16'"),
        ({"sorce": "builtin"}, r"prepare.sorce"),
        (
            {"source": "/nonexistent/model"},
            r"params.yaml:\d+: prepare.source=/nonexistent/model: no such folder; use `builtin` or a directory "
            r"written by save_pretrained$",
        ),
        ({"source": "recipes"}, r"prepare.source=recipes: not a Hugging Face model directory \(no config.json\)"),
    ],
)
def test_a_prepare_block_prepare_cannot_load_is_refused(params, prepare, message):
    def change(doc):
        doc["prepare"].update(prepare)

    one_line_error(lambda: check_prepare(params(change)), message)


def test_a_max_model_len_longer_than_the_models_context_is_refused(params, tmp_path):
    """vLLM refuses to start such a server; once, that was found at the first server, after every build."""
    import gguf  # requirements/pipeline.txt: transformers reads the builtin model with it

    from quantgate.prepare_params import BUILTIN_CONTEXT, builtin_gguf

    field = gguf.GGUFReader(str(builtin_gguf())).fields["llama.context_length"]
    assert BUILTIN_CONTEXT == int(field.parts[field.data[0]][0])  # the constant is the shipped model's

    def longer(doc):
        doc["evaluate"]["serve"]["max_model_len"] = 10000

    path = params(longer)
    one_line_error(
        lambda: check_context_length(check_prepare(path), check_evaluate(BUILDS, path), path),
        r"params.yaml:\d+: evaluate.serve.max_model_len 10000 is longer than the model's context \(8192 tokens, "
        r"HuggingFaceTB/SmolLM2-135M-Instruct's context\); vLLM would refuse to start: lower it to 8192 or less",
    )
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"max_position_embeddings": 4096}')

    def local(doc):
        doc["prepare"]["source"] = str(tmp_path / "model")
        doc["evaluate"]["serve"]["max_model_len"] = 5000

    path = params(local)
    one_line_error(
        lambda: check_context_length(check_prepare(path), check_evaluate(BUILDS, path), path),
        rf"\(4096 tokens, max_position_embeddings in {tmp_path}/model/config.json\)",
    )
    for fits in (4096, -1):

        def at(doc, fits=fits):
            local(doc)
            doc["evaluate"]["serve"]["max_model_len"] = fits

        path = params(at)
        check_context_length(check_prepare(path), check_evaluate(BUILDS, path), path)
    # linear RoPE scaling: vLLM serves 1024 x 4 tokens, so 5000 is its to refuse, not validate's
    (tmp_path / "model" / "config.json").write_text(
        '{"max_position_embeddings": 1024, "rope_scaling": {"type": "linear", "factor": 4}}'
    )
    path = params(local)
    check_context_length(check_prepare(path), check_evaluate(BUILDS, path), path)
    (tmp_path / "model" / "config.json").write_text('{"max_position_embeddings": true}')
    one_line_error(
        lambda: check_context_length(check_prepare(path), check_evaluate(BUILDS, path), path),
        r"config.json: max_position_embeddings True is no number of tokens; fix config.json$",
    )
    (tmp_path / "model" / "config.json").write_text("[]")
    one_line_error(
        lambda: check_prepare(path),
        r"params.yaml:\d+: .*model/config.json: not a JSON object of model settings; write it with save_pretrained$",
    )


def test_a_local_model_directory_passes_as_prepare_source(params, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")

    def change(doc):
        doc["prepare"]["source"] = str(tmp_path / "model")

    assert check_prepare(params(change)).source == str(tmp_path / "model")


def test_the_search_recipe_is_recognised_however_its_path_is_spelled(params):
    def int8_reads_it(doc):
        doc["quantize"]["int8"]["recipe"] = "./results/search/recipe.yaml"

    path = params(int8_reads_it)
    one_line_error(
        lambda: check_search(BUILDS, path),
        r"params.yaml:\d+: quantize.int8.recipe is results/search/recipe.yaml, which the search writes for "
        r"search.build \(int4-mixed\) only; give quantize.int8 its own recipe \(to search for int8 instead, also "
        r"give quantize.int4-mixed its own and set search.build: int8\)$",
    )

    def mixed_spelled_so(doc):
        doc["quantize"]["int4-mixed"]["recipe"] = "./results/search/recipe.yaml"

    assert check_search(BUILDS, params(mixed_spelled_so)).build == "int4-mixed"  # the same file: accepted


@pytest.mark.parametrize(
    "search, message",
    [
        ({"recipe": "results/search/recipe.yaml", "base": "int4-mixed"}, r"neither can be what it writes"),
        ({"base": "int4-mixed"}, r"neither can be what it writes"),
        ({"build": "fp16"}, r"search.build is fp16, the 16-bit build prepare makes"),
        ({"build": ""}, r"search.build: String should have at least 1 character"),
        ({"recipe": None}, r"search.recipe is missing \(dvc.yaml's search stage reads \$\{search.recipe\}\)"),
        ({"recipe": "recipes/nosuch.yaml"}, r"search.recipe recipes/nosuch.yaml: no such file"),
        ({"recipe": "recipes/int8.yaml"}, r"search.base int4 is made with recipes/int4.yaml .* not with"),
        ({"max_bits_per_weight": 3}, r"search.max_bits_per_weight: Input should be greater than or equal to 4"),
        ({"max_bits_per_weight": 100}, r"search.max_bits_per_weight: Input should be less than or equal to 16"),
        (
            {"max_bits_per_weight": 4.2},
            r"search.max_bits_per_weight 4.2 is below the 4.25 bits per weight search.recipe recipes/int4.yaml stores",
        ),
        ({"fused": {"qkv_proj": []}}, r"fused.qkv_proj must list the two or more layers"),
        ({"fused": {"qkv_proj": ["q_proj", "q_proj", "v_proj"]}}, r"fused.qkv_proj lists q_proj twice"),
        (
            {"fused": {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "q_proj"]}},
            r"fused.gate_up_proj lists q_proj in fused.qkv_proj too",
        ),
    ],
)
def test_a_search_block_the_search_cannot_run_as_written_is_refused(params, search, message):
    def change(doc):
        doc["search"] |= search

    path = params(change)
    one_line_error(lambda: check_search(BUILDS, path), rf"^{re.escape(str(path))}(:\d+)?: .*{message}")


def test_a_search_recipe_that_is_no_file_is_refused(params):
    def change(doc):
        doc["search"]["recipe"] = doc["quantize"]["int4"]["recipe"] = "recipes/nosuch.yaml"

    path = params(change)
    one_line_error(lambda: check_search(BUILDS, path), r"search.recipe recipes/nosuch.yaml: no such file")


@pytest.mark.parametrize(
    "block, message",
    [
        ("recipes/fp8.yaml", r"quantize.fp8"),
        (None, r"quantize.fp8"),
        ({"recipe": "recipes/fp8.yaml", "kv_cache_dtype": "fp9"}, r"quantize.fp8.kv_cache_dtype"),
        ({"recipe": "recipes/fp8.yaml", "recipe_": "x"}, r"quantize.fp8.recipe_"),
        ({"recipe": "recipes/nosuch.yaml"}, r"quantize.fp8.recipe recipes/nosuch.yaml: no such file"),
        ({"recipe": "recipes/fp8.yaml", "w4a8": "yes"}, r'quantize.fp8.w4a8: "yes" is not true or false; write w4a8'),
    ],
)
def test_each_quantize_block_is_read_as_the_quantize_stage_reads_it(params, block, message):
    def change(doc):
        doc["quantize"]["fp8"] = block

    path = params(change)
    one_line_error(lambda: check_quantize(BUILDS, path), rf"^{re.escape(str(path))}(:\d+)?: .*{message}")


def line_of_text(path: Path, text: str) -> int:
    """The 1-based line of `path` that starts, stripped, with `text`."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip().startswith(text))


def test_a_recipe_file_llm_compressor_cannot_parse_is_refused_at_its_line(params):
    """Before, only the file's existence was checked: README.md passed and stopped quantize@fp8 (load_recipe)."""
    shutil.copy(REPO / "README.md", "README.md")
    path = params(lambda doc: doc["quantize"]["fp8"].update(recipe="README.md"))
    line = line_of_text(path, "recipe: README.md")
    one_line_error(
        lambda: check_quantize(BUILDS, path),
        rf"^{re.escape(str(path))}:{line}: quantize.fp8.recipe README.md is not an llm-compressor recipe: README.md:"
        r"\d+: invalid YAML: [^;]*; name one under recipes/ \(recipes/README.md\)$",
    )


def test_a_recipe_that_needs_data_without_calibration_is_refused_at_its_block(params):
    """int8's SmoothQuant + GPTQ recipe with no quantize.int8.calibration passed and stopped quantize@int8."""
    path = params(lambda doc: doc["quantize"]["int8"].pop("calibration"))
    lines = path.read_text().splitlines()
    line = lines.index("  int8:") + 1
    one_line_error(
        lambda: check_quantize(BUILDS, path),
        rf"^{re.escape(str(path))}:{line}: quantize.int8: recipes/int8.yaml uses SmoothQuantModifier, GPTQModifier, "
        r"which needs calibration data; add calibration: \{samples: 256, seq_len: 512\} to the block$",
    )


def test_a_sequential_only_recipe_in_the_basic_pipeline_is_refused_at_its_line(params):
    path = params(lambda doc: doc["quantize"]["int4"].update(recipe="recipes/sweep/int4_awq_g64.yaml"))
    lines = path.read_text().splitlines()
    start = lines.index("    recipe: recipes/sweep/int4_awq_g64.yaml")
    line = next(i for i in range(start, len(lines)) if lines[i].strip() == "pipeline: basic") + 1
    one_line_error(
        lambda: check_quantize(BUILDS, path),
        rf"^{re.escape(str(path))}:{line}: recipes/sweep/int4_awq_g64.yaml \(quantize.int4.recipe\): AWQModifier "
        r"fits its scales .*; set quantize.int4.calibration.pipeline: sequential \(it is basic\)$",
    )


@pytest.mark.parametrize(
    "change, key",
    [
        (lambda doc: doc["search"].update(kl_samples=65), "search.kl_samples asks for 65"),
        (
            lambda doc: doc["quantize"]["int4-mixed"]["calibration"].update(samples=640),
            "quantize.int4-mixed.calibration.samples asks for 640",
        ),
    ],
)
def test_calibration_counts_beyond_the_calibrate_stages_file_are_refused(params, change, key):
    path = params(change)
    search, blocks = check_search(BUILDS, path), check_quantize(BUILDS, path)
    one_line_error(
        lambda: check_samples(search, blocks, check_calibrate(path), path),
        rf"{key} calibration conversations, but results/calibration.jsonl holds calibrate.samples = 64",
    )


def test_a_build_list_without_the_16_bit_build_is_refused(params):
    def change(doc):
        doc["builds"] = BUILDS[1:]

    path = params(change)
    one_line_error(lambda: load_builds(path), r"has no fp16: every build is gated against the 16-bit build")


def test_a_doc_budget_below_one_look_at_every_team_is_refused_when_the_search_runs(params):
    teams = load_teams(REPO / "evals")
    need = sum(min(40, task.n_docs) for t in teams for task in t.tasks)  # search.looks[0] = 40
    short = params(lambda doc: doc["search"].update(doc_budget=need - 1))
    search = check_search(BUILDS, short)
    one_line_error(
        lambda: check_doc_budget(search, teams, BUILDS, short),
        rf"search.doc_budget {need - 1} cannot pay for one look at every team: {need} documents "
        rf"\(40 per task, search.looks\[0\]\); raise it to {need} or more",
    )
    without_search = [b for b in BUILDS if b != "int4-mixed"]
    check_doc_budget(search, teams, without_search, short)  # no search: nothing to pay for
    enough = params(lambda doc: doc["search"].update(doc_budget=need))
    check_doc_budget(check_search(BUILDS, enough), teams, BUILDS, enough)


def test_the_budget_ignores_evaluate_harness_limit_as_the_search_does(params):
    teams = load_teams(REPO / "evals")
    need = sum(min(40, task.n_docs) for t in teams for task in t.tasks)  # the search scores its own 40 per task
    path = params(lambda doc: (doc["evaluate"]["harness"].update(limit=5), doc["search"].update(doc_budget=need - 1)))
    one_line_error(
        lambda: check_doc_budget(check_search(BUILDS, path), teams, BUILDS, path),
        rf"cannot pay for one look at every team: {need} documents \(40 per task, search.looks\[0\]\)",
    )


def test_a_search_recipe_is_a_file_even_when_the_search_is_skipped(params):
    def change(doc):
        doc["builds"].remove("int4-mixed")
        del doc["quantize"]["int4-mixed"]
        doc["search"]["recipe"] = "recipes/nope.yaml"

    path = params(change)
    one_line_error(
        lambda: check_search(load_builds(path), path),
        r"search.recipe recipes/nope.yaml: no such file; name the recipe int4-mixed falls back from",
    )


def test_one_recipe_file_spelled_absolute_or_relative_is_the_same_recipe(params, tmp_path):
    def change(doc):
        doc["search"]["recipe"] = str(tmp_path / "recipes/int4.yaml")

    assert check_search(BUILDS, params(change)).base == "int4"


def test_each_refusal_names_the_line_of_its_key(params):
    """The line is the key's own, or its block's where the key is missing."""
    path = params(lambda doc: doc["search"].update(doc_budget=1))
    lines = path.read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.strip().startswith("doc_budget:"))
    teams = load_teams(REPO / "evals")
    message = one_line_error(lambda: check_doc_budget(check_search(BUILDS, path), teams, BUILDS, path), "doc_budget")
    assert message.startswith(f"{path}:{line}: search.doc_budget 1 cannot pay")
    path = params(lambda doc: doc["search"].pop("recipe"))
    block = path.read_text().splitlines().index("search:") + 1
    assert one_line_error(lambda: check_search(BUILDS, path), "missing").startswith(
        f"{path}:{block}: search.recipe is missing"
    )
    path = params(lambda doc: doc["quantize"]["int8"].update(recipe="recipes/nope.yaml"))
    line = path.read_text().splitlines().index("    recipe: recipes/nope.yaml") + 1
    assert one_line_error(lambda: check_quantize(BUILDS, path), "no such file").startswith(
        f"{path}:{line}: quantize.int8.recipe recipes/nope.yaml: no such file"
    )


def test_calibrate_samples_above_every_conversation_there_is_is_refused(params):
    recorded = sum(1 for line in (REPO / "recipes/calibration/recorded.jsonl").read_text().splitlines() if line)
    path = params(lambda doc: doc["calibrate"].update(samples=recorded + 24 + 1))
    message = one_line_error(lambda: check_calibration_supply(24, check_calibrate(path), path), "record more")
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.strip().startswith("samples:"))
    assert message.startswith(
        f"{path}:{line}: calibrate.samples {recorded + 25} asks for more calibration conversations than there are: "
        f"24 of the teams' own and {recorded} recorded in recipes/calibration/recorded.jsonl; lower it to "
        f"{recorded + 24} or fewer, or record more with `make calibration`"
    )
    bound = params(lambda doc: doc["calibrate"].update(samples=recorded + 24))
    check_calibration_supply(24, check_calibrate(bound), bound)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"samples": "64"}, r"calibrate.samples: Input should be a valid integer; got str '64' \(a number in quotes"),
        ({"temperature": -1}, r"calibrate.temperature: Input should be greater than or equal to 0; got int -1$"),
        ({"sample": 64}, r"calibrate.sample: unknown key \(the keys here: prompts, samples, "),
        ({"samples": -3}, r"calibrate.samples: Input should be greater than 0; got int -3$"),
        # each prompt's request seed is seed + its index: vLLM refused 2**63 and more on every request
        ({"seed": 2**63}, r"calibrate.seed: Input should be less than or equal to 4294967295; got int "),
        (
            {"prompts": "nope.yaml"},
            r"calibrate.prompts nope.yaml: no such file; name the prompt set \(recipes/calibration/prompts.yaml "
            r"by default\) or fix the path$",
        ),
    ],
)
def test_the_calibrate_block_is_read_as_the_calibrate_stage_reads_it_at_its_line(params, change, message):
    """Each passed validate and stopped the calibrate stage; samples: -3 was named as
    quantize.int8.calibration.samples asking for more than there are."""
    path = params(lambda doc: doc["calibrate"].update(change))
    key = next(iter(change))
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.strip().startswith(f"{key}:"))
    one_line_error(lambda: check_calibrate(path), rf"^{re.escape(str(path))}:{line}: {message}")


def test_a_calibration_prompt_set_that_is_malformed_is_refused_naming_its_file(params, tmp_path):
    (tmp_path / "bad.yaml").write_text("topics: [a]\ntasks: [no topic here]\n")
    path = params(lambda doc: doc["calibrate"].update(prompts=str(tmp_path / "bad.yaml")))
    one_line_error(lambda: check_calibrate(path), r"bad.yaml:2: tasks: every task must contain \{topic\}")


@pytest.mark.parametrize("recipe, scheme", [("recipes/int8.yaml", "W8A8"), ("recipes/fp8.yaml", "FP8_DYNAMIC")])
def test_w4a8_on_a_recipe_that_is_not_w4a16_is_refused_at_its_line(params, recipe, scheme):
    def change(doc):
        doc["builds"].append("x-w4a8")
        doc["quantize"]["x-w4a8"] = {"recipe": recipe, "w4a8": True}

    path = params(change)
    message = one_line_error(
        lambda: check_quantize(BUILDS + ["x-w4a8"], path),
        rf"quantize.x-w4a8.w4a8: true serves W4A16 weights .* as W4A8, and {recipe} declares {scheme}; give the block",
    )
    assert re.match(rf"{re.escape(str(path))}:(\d+): ", message).group(1) == str(
        next(i for i, line in enumerate(path.read_text().splitlines(), 1) if "w4a8: true" in line)
    )


def test_int4s_recipe_served_as_w4a8_passes_and_the_schemes_are_read_from_the_yaml(params):
    def change(doc):
        doc["builds"].append("int4-w4a8")
        doc["quantize"]["int4-w4a8"] = dict(doc["quantize"]["int4"], w4a8=True)

    path = params(change)
    blocks = check_quantize(BUILDS + ["int4-w4a8"], path)
    assert blocks["int4-w4a8"].w4a8 and not blocks["int4"].w4a8
    from quantgate.recipes import declared_schemes

    assert declared_schemes(Path("recipes/int4.yaml")) == ["W4A16"]
    assert declared_schemes(Path("recipes/int8.yaml")) == ["W8A8"]


def test_a_search_base_served_as_w4a8_is_refused_at_its_line(params):
    def change(doc):
        doc["builds"].append("int4-w4a8")
        doc["quantize"]["int4-w4a8"] = dict(doc["quantize"]["int4"], w4a8=True)
        doc["search"]["base"] = "int4-w4a8"

    path = params(change)
    one_line_error(
        lambda: check_search(BUILDS + ["int4-w4a8"], path),
        rf"^{re.escape(str(path))}:\d+: search.base int4-w4a8 is served as W4A8 .*drop quantize.int4-w4a8.w4a8",
    )
    # int4 itself made W4A8: the advice is to keep it W4A16 and add a build of its own, not to name int4 again
    path = params(lambda doc: doc["quantize"]["int4"].update(w4a8=True))
    line = next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if ln.strip() == "w4a8: true")
    one_line_error(
        lambda: check_search(BUILDS, path),
        rf"^{re.escape(str(path))}:{line}: search.base int4 is served as W4A8 .*drop quantize.int4.w4a8 \(to serve",
    )


def test_w4a8_reads_scheme_names_as_llm_compressor_does_and_says_where_int8_activations_come_from(params, tmp_path):
    recipes = {
        "lower": "quant_stage:\n  quant_modifiers:\n    QuantizationModifier: {targets: [Linear], scheme: w4a16}\n",
        "acts": (
            "quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      config_groups:\n        g:\n"
            "          targets: [Linear]\n"
            "          weights: {num_bits: 4, type: int, strategy: group, group_size: 64}\n"
            "          input_activations: {num_bits: 8, type: int, dynamic: true}\n"
        ),
    }
    for name, text in recipes.items():
        (tmp_path / f"{name}.yaml").write_text(text)

    def with_recipe(name):
        def change(doc):
            doc["builds"].append("x-w4a8")
            doc["quantize"]["x-w4a8"] = {"recipe": str(tmp_path / f"{name}.yaml"), "w4a8": True}

        return params(change)

    assert check_quantize(BUILDS + ["x-w4a8"], with_recipe("lower"))["x-w4a8"].w4a8  # scheme: w4a16 is W4A16
    one_line_error(
        lambda: check_quantize(BUILDS + ["x-w4a8"], with_recipe("acts")),
        r"acts.yaml declares W4A8; .*the int8 activations come from vLLM at serving, not from the recipe",
    )


def test_the_build_the_search_writes_cannot_be_served_as_w4a8(params):
    def change(doc):
        doc["quantize"]["int4-mixed"]["w4a8"] = True

    path = params(change)
    one_line_error(
        lambda: check_search(BUILDS, path),
        rf"^{re.escape(str(path))}:\d+: quantize.int4-mixed.w4a8: the search screens int4-mixed's candidates at "
        r"16-bit activations .*drop w4a8 here",
    )


@pytest.mark.parametrize(
    "block, key, value, field",
    [
        ("serve", "max_slowdown", "fast", "evaluate.serve.max_slowdown"),
        ("serve", "dtype", "bf16", "evaluate.serve.dtype"),
        ("serve", "max_slowdwn", 5, "evaluate.serve.max_slowdwn"),
        ("harness", "num_concurrent", 0, "evaluate.harness.num_concurrent"),
        ("harness", "seed", -1, "evaluate.harness.seed: Input should be greater than or equal to 0"),
        ("harness", "seed", 2**32, "evaluate.harness.seed: Input should be less than or equal to 4294967295"),
    ],
)
def test_a_bad_serving_field_stops_validate_naming_its_line(params, block, key, value, field):
    """Before, a bad evaluate.serve field passed validate and stopped the run at the first stage that served a
    build, after prepare and calibrate; a harness seed outside numpy's [0, 2**32 - 1] stopped every evaluate (and
    the search) in lm-eval's np.random.seed, with its ValueError traceback."""
    path = params(lambda doc: doc["evaluate"][block].update({key: value}))
    lines = path.read_text().splitlines()
    at = lines.index("evaluate:")
    for name in (f"{block}:", f"{key}:"):  # the key's line, under evaluate: and its block
        at = next(i for i in range(at, len(lines)) if lines[i].strip().startswith(name))
    line = at + 1
    one_line_error(lambda: check_evaluate(BUILDS, path), rf"^{re.escape(str(path))}:{line}: .*{re.escape(field)}")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda e: e.update({"harnes": {}}), r"evaluate.harnes: unknown key"),
        (
            lambda e: e.update({"endpoints": {"int4": {"url": "ftp://x", "dtype": "bfloat16"}}}),
            r"evaluate.endpoints.int4.url: .*not an http\(s\) URL ending in /v1",
        ),
        (
            lambda e: e.update({"endpoints": {"int5": {"url": "http://10.0.0.5:8000/v1", "dtype": "bfloat16"}}}),
            r"evaluate.endpoints.int5: not a build of this run",
        ),
    ],
)
def test_the_whole_evaluate_block_is_checked_as_evaluate_reads_it(params, change, message):
    """Each passed validate and stopped evaluate@<build> after prepare, calibrate and the quantize stages."""
    path = params(lambda doc: change(doc["evaluate"]))
    one_line_error(lambda: check_evaluate(BUILDS, path), rf"^{re.escape(str(path))}:\d+: {message}")


def test_an_out_file_validate_cannot_write_is_one_line_and_exit_2(tmp_path):
    """It was a FileNotFoundError traceback and exit 1 (`/proc/x.json`); here a file stands where its folder
    should be, which fails the same way on any system and for any user."""
    import subprocess
    import sys

    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "teams.json"
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.validate", "evals", str(out)],
        cwd=checkout_view(tmp_path / "view"),  # its log goes there, not into the checkout
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [f"quantgate: error: {out}: cannot make its folder (File exists)"]


@pytest.mark.parametrize(
    "key, value, message",
    [  # a union's members were two garbled problems: "kv_cache_gib.constrained-int: ...; kv_cache_gib.literal['auto']"
        ("kv_cache_gib", "auto2", "kv_cache_gib: Input should be a valid integer or 'auto'; got str 'auto2'"),
        ("enforce_eager", "maybe", "enforce_eager: Input should be a valid boolean or 'auto'; got str 'maybe'"),
        (
            "max_slowdown",
            "1e3",
            "max_slowdown: Input should be a valid number; got str '1e3' (YAML 1.1 reads 1e3 as text: write 1.0e+3)",
        ),
        (
            "max_model_len",
            "3",
            "max_model_len: Input should be a valid integer; got str '3' (a number in quotes is "
            "text: write it unquoted)",
        ),
        ("max_model_len", "nan", "max_model_len: Input should be a valid integer; got str 'nan'"),
        (
            "kv_cache_gib",
            "4",
            "kv_cache_gib: Input should be a valid integer or 'auto'; got str '4' (a number in quotes "
            "is text: write it unquoted)",
        ),
        (
            "max_model_len",
            "2e3",
            "max_model_len: Input should be a valid integer; got str '2e3' (YAML 1.1 reads 2e3 as text: write 2000)",
        ),
        (  # once "write 1.0e+400", which YAML reads as .inf, refused in turn
            "max_slowdown",
            "1e400",
            "max_slowdown: Input should be a valid number; got str '1e400' (1e400 is beyond any float: write a "
            "finite number)",
        ),
        ("dtype", "16", "dtype: Input should be 'auto', 'bfloat16', 'float16' or 'float32'; got str '16'"),
        (
            "devices",
            0,
            "devices: Input should be a valid string; got int 0 (YAML reads it as a number: put it in quotes "
            "as you wrote it)",
        ),
        ("port", 70000, "port: Input should be less than or equal to 65535; got int 70000"),
    ],
)
def test_a_bad_value_is_one_problem_saying_what_was_given(params, key, value, message):
    path = params(lambda doc: doc["evaluate"]["serve"].update({key: value}))
    if value in ("1e3", "2e3"):  # as a user writes it; safe_dump would quote the string
        path.write_text(path.read_text().replace(f"'{value}'", value))
    got = one_line_error(lambda: check_evaluate(BUILDS, path), r"evaluate\.serve\.")
    assert got.split("evaluate.serve.", 1)[1] == message


@pytest.mark.parametrize(
    "block, key, value, message",
    [
        ("gate", "bootstrap_resamples", "lots", r"gate.bootstrap_resamples: Input should be a valid integer"),
        ("executor", "kind", "locl", r"executor.kind: Input should be 'local' or 'ray'; got str 'locl'"),
        ("cost", "qps", -1, r"cost.qps: Input should be greater than 0"),
        ("gate", "baseline", "int4", r"gate.baseline: 'int4' is not the 16-bit build; the baseline is the one prepare"),
        ("profile", "concurrency", [], r"profile.concurrency: List should have at least 1 item after validation"),
        ("profile", "concurrency", [1, 0], r"profile.concurrency.1: Input should be greater than or equal to 1"),
        ("profile", "concurrency", [8, 1, 8], r"profile.concurrency: 8 is given twice in \[8, 1, 8\]; give each"),
        ("profile", "concurrency", [4, 4, 4], r"profile.concurrency: 4 is given 3 times in \[4, 4, 4\]; give each"),
        ("profile", "seed", -5, r"profile.seed: Input should be greater than or equal to 0"),
        ("profile", "output_len", 1, r"profile.output_len: Input should be greater than or equal to 2"),  # no TPOT
        ("gate", "seed", -1, r"gate.seed: Input should be greater than or equal to 0"),
        (
            "gate",
            "bootstrap_resamples",
            10**9,
            r"gate.bootstrap_resamples: Input should be less than or equal to 100000",
        ),
        ("profile", "cpu_cores", "abc", r"profile.cpu_cores: 'abc' is not a core list"),
        (
            "profile",
            "cpu_cores",
            1,
            r"profile.cpu_cores: Input should be a valid string; got int 1 \(YAML reads it as a number: put it in "
            r"quotes as you wrote it\)",
        ),
        (
            "profile",
            "input_len",
            99999,
            r"profile.input_len: input_len \+ output_len = 100015 tokens, over "
            r"evaluate.serve.max_model_len 2048: vLLM would refuse every benchmark request",
        ),
        (
            "register",
            "model_name",
            "team/model",
            r"register.model_name: 'team/model': MLflow refuses a model name with",
        ),
        ("register", "model_name", "..", r"register.model_name: '..': MLflow refuses a model name that reads as a rel"),
        ("register", "experiment", "x" * 501, r"register.experiment: 501 characters; MLflow takes at most 500"),
        (
            "register",
            "model_name",
            "m" * 223,
            r"register.model_name: 223 characters; at most 222 for a model quantgate changes \(MLflow's SQL stores",
        ),
        ("profile", "seed", 2**32, r"profile.seed: Input should be less than or equal to 4294967295"),
        ("profile", "timeout_s", "10m", r"profile.timeout_s: Input should be a valid integer.*; got str '10m'"),
        ("register", "model_name", " ", r"register.model_name: must not be empty or blank"),
        ("register", "experimnt", "x", r"register.experimnt: unknown key \(the keys here: model_name, experiment\)"),
    ],
)
def test_the_blocks_later_stages_read_are_checked_here(params, block, key, value, message):
    """Each passed validate and stopped the search, gate, an evaluate, profile or the register stage after the
    builds were made (profile and register: after every build was scored; a negative gate.seed: numpy's default_rng
    ValueError in the gate, for a team with a continuous metric)."""
    path = params(lambda doc: doc[block].update({key: value}))
    one_line_error(
        lambda: check_later_blocks(check_evaluate(BUILDS, path), path), rf"^{re.escape(str(path))}:\d+: {message}"
    )


def test_a_key_named_like_a_type_is_kept_in_the_field_path(params):
    """A build, team or resource may be called "int" or "str": only the parts pydantic adds for a union's member
    leave the path, found from the model's annotations, not by name."""
    path = params(lambda doc: doc["executor"].update({"resources": {"int": "many", "str": "x"}}))
    got = one_line_error(lambda: check_later_blocks(check_evaluate(BUILDS, path), path), r"executor\.resources\.int")
    assert "executor.resources.int: Input should be a valid number; got str 'many'" in got
    assert "executor.resources.str: Input should be a valid number; got str 'x'" in got


def test_the_longest_model_name_validate_takes_fits_mlflows_column_with_the_registry_locks_suffix():
    """register_params.MAX_MODEL_NAME restates registry/lock.py's suffixes (quantgate/ does not import registry/):
    the longest name's broken lock, <name>.quantgate-lock.stale.<12 hex>, must fit MLflow's String(256)."""
    from quantgate.register_params import MAX_MODEL_NAME
    from registry.lock import lock_name

    assert len(f"{lock_name('m' * MAX_MODEL_NAME)}.stale.{'0' * 12}") == 256


@pytest.mark.parametrize(
    "change, key, message",
    [
        (
            {"context_tokens": 100000},
            "context_tokens",
            r"cost.context_tokens: 100000 tokens is longer than the server's max_model_len \(2048, "
            r"evaluate.serve.max_model_len\); lower it or raise max_model_len$",
        ),
        (
            {"context_tokens": 200, "output_tokens": 250},
            "output_tokens",
            r"cost.output_tokens: 250 tokens is not less than cost.context_tokens \(200\), which counts the prompt "
            r"and these output tokens of one request; lower output_tokens or raise context_tokens$",
        ),
    ],
)
def test_a_cost_request_no_server_of_this_run_can_hold_is_refused_at_its_line(params, change, key, message):
    """Both passed validate; the first stopped the gate (pipeline/buys.py load_cost) after every build was scored."""
    path = params(lambda doc: doc["cost"].update(change))
    line = line_of_text(path, f"{key}:")
    one_line_error(
        lambda: check_later_blocks(check_evaluate(BUILDS, path), path), rf"^{re.escape(str(path))}:{line}: {message}"
    )


def test_cost_context_tokens_is_unchecked_when_vllm_fits_max_model_len(params):
    path = params(
        lambda doc: (doc["cost"].update(context_tokens=100000), doc["evaluate"]["serve"].update(max_model_len=-1))
    )
    check_later_blocks(check_evaluate(BUILDS, path), path)


@pytest.mark.parametrize(
    "key, message",
    [
        ("python", "the serving env's interpreter, e.g. .venv-serve/bin/python"),
        ("host", "the address vLLM listens on, e.g. 127.0.0.1"),
    ],
)
def test_an_empty_serving_python_or_host_is_refused_at_its_line(params, key, message):
    """Both passed validate and failed at the first server ("" as a python is the current folder, which exists)."""
    path = params(lambda doc: doc["evaluate"]["serve"].update({key: ""}))
    line = line_of_text(path, f"{key}: ''")
    one_line_error(
        lambda: check_evaluate(BUILDS, path),
        rf"^{re.escape(str(path))}:{line}: evaluate.serve.{key}: must not be empty or blank: give "
        rf"{re.escape(message)}$",
    )


@pytest.mark.parametrize(
    "python, problem", [("nowhere/bin/python", "not found"), ("plain", "is not an executable file")]
)
def test_a_serving_python_this_machine_cannot_run_is_refused_at_its_line(params, python, problem):
    """Both passed validate and failed at the first server, after prepare, calibrate and the quantize stages."""
    Path("plain").write_text("")
    path = params(lambda doc: doc["evaluate"]["serve"].update(python=python))
    line = line_of_text(path, f"python: {python}")
    one_line_error(
        lambda: check_serving_python(check_evaluate(BUILDS, path), path),
        rf"^{re.escape(str(path))}:{line}: evaluate.serve.python {python} {problem}; run `make setup` \(it makes "
        r"the serving env, .venv-serve\) or fix the path$",
    )


def test_a_serving_python_without_vllm_is_refused_and_the_serving_env_passes(params):
    import sys

    path = params(lambda doc: doc["evaluate"]["serve"].update(python=sys.executable))  # the pipeline env: no vLLM
    one_line_error(
        lambda: check_serving_python(check_evaluate(BUILDS, path), path),
        rf"evaluate.serve.python {re.escape(sys.executable)} cannot import vllm \(no such module there\); run `make",
    )
    serving = str(REPO / ".venv-serve" / "bin" / "python")
    check_serving_python(check_evaluate(BUILDS, params(lambda doc: doc["evaluate"]["serve"].update(python=serving))))


def test_a_serving_python_this_machine_can_run_passes(params, tmp_path):
    (tmp_path / "python").write_text("#!/bin/sh\n")
    (tmp_path / "python").chmod(0o755)
    path = params(lambda doc: doc["evaluate"]["serve"].update(python=str(tmp_path / "python")))
    check_serving_python(check_evaluate(BUILDS, path), path)


@pytest.mark.parametrize(
    "change, key, message",
    [
        (
            {"store": "ftp://x"},
            "store",
            r"executor.store: 'ftp://x' is not a store: give a URL every node can read \(s3://bucket/prefix, gs://, "
            r"az:// or file://\), an absolute shared path, or null for the project's default DVC remote$",
        ),
        ({"store": "builds"}, "store", r"executor.store: 'builds' is not a store: "),
        (
            {"node_cache": ""},
            "node_cache",
            r"executor.node_cache: '' is not an absolute path: a task runs in a scratch folder removed after it, so "
            r"the builds would be fetched again every time; give a folder on the node's own disk, e.g. "
            r"/tmp/quantgate/builds$",
        ),
        (
            {"kind": "ray"},
            "address",
            r"executor.kind is ray but no cluster address: set executor.address \(host:port of the head\) or "
            r"RAY_ADDRESS$",
        ),
    ],
)
def test_an_executor_block_evaluate_cannot_use_is_refused_at_its_line(params, monkeypatch, change, key, message):
    """Each passed validate and stopped evaluate@<build> (cluster_address, or the store inside every task)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = params(lambda doc: doc["executor"].update(change))
    line = line_of_text(path, f"{key}:")
    one_line_error(
        lambda: check_later_blocks(check_evaluate(BUILDS, path), path), rf"^{re.escape(str(path))}:{line}: {message}"
    )


def test_a_ray_executor_with_ray_address_set_and_stores_of_every_kind_pass(params, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    for store in ("s3://bucket/prefix", "file:///shared/builds", "/shared/builds", None):
        path = params(lambda doc, store=store: doc["executor"].update(kind="ray", store=store))
        check_later_blocks(check_evaluate(BUILDS, path), path)


def test_a_block_no_stage_reads_is_refused_with_the_closest_name(params, tmp_path):
    from quantgate.params import check_blocks, load_builds

    def typo(doc):
        doc["evalute"] = {"serve": {"dtype": "bfloat16"}}  # its settings would never reach a server
        doc["_shared"] = {"port": 0}  # a key for YAML anchors is free

    path = params(typo)
    expected = r":\d+: evalute: no stage or command reads this block; did you mean evaluate\? \(a key starting with _"
    one_line_error(lambda: load_builds(path), rf"^{re.escape(str(path))}{expected} is free for YAML anchors\)$")
    odd = params(lambda doc: doc.update({"zzz": 1}))
    one_line_error(lambda: check_blocks(odd), r": zzz: no stage or command reads this block; the blocks are builds, ")
    for text, what in (("", "an empty file"), ("- builds\n", "list")):
        (tmp_path / "odd.yaml").write_text(text)
        one_line_error(
            lambda: load_builds(tmp_path / "odd.yaml"), rf"odd.yaml: must be a mapping of blocks .*got {what}$"
        )


def test_calibrate_settings_the_recorded_set_was_not_made_with_are_refused_before_prepare(params):
    from pipeline.validate import check_calibrate

    path = params(lambda doc: doc["calibrate"].update(temperature=0.5))
    one_line_error(
        lambda: check_calibrate(path),
        rf"^{re.escape(str(path))}:\d+: calibrate: recipes/calibration/recorded.json: recorded with other calibrate "
        r"settings \(temperature 0.7 vs 0.5 now\); restore them or make one with `make calibration`",
    )
    assert check_calibrate(params()).temperature == 0.7  # the shipped settings are the recorded ones


def test_a_calibrate_prompts_file_that_is_no_prompt_set_names_the_key_and_the_file(params, tmp_path):
    from pipeline.validate import check_calibrate

    (tmp_path / "notes.yaml").write_text("- just\n- a list\n")
    path = params(lambda doc: doc["calibrate"].update(prompts="notes.yaml"))
    one_line_error(
        lambda: check_calibrate(path), rf"^{re.escape(str(path))}:\d+: calibrate.prompts notes.yaml: notes.yaml"
    )


@pytest.mark.parametrize(
    "text, said",
    [
        (
            "a: !function foo\n",
            "x.yaml:1: invalid YAML: could not determine a constructor for the tag '!function'; "
            "custom tags (like !function) are not allowed: write plain YAML",
        ),
        ("? [a, b]\n: sk\n", "x.yaml:1: invalid YAML: found unhashable key"),  # no word of tags: there is none
        ("a: 1\na: 2\n", "x.yaml:2: invalid YAML: duplicate key 'a' (first on line 1); keep one"),
    ],
)
def test_a_yaml_constructor_error_says_what_it_is_and_only_a_tag_gets_the_tag_advice(tmp_path, text, said):
    path = tmp_path / "x.yaml"
    path.write_text(text)
    with pytest.raises(QuantgateError) as err:
        read_yaml(path)
    assert str(err.value).removeprefix(f"{tmp_path}/") == said
