"""pipeline.search without a real model: the RTN fake quantization, the bits arithmetic, the bisection
and its choice, the recipe it writes, the KL ranking on a tiny random Llama, and the whole search on it
with its screens faked (one that keeps no layer, as on the e2e project), through the gate and register."""

import math
import re

import pytest
import torch
import yaml
from compressed_tensors.quantization import QuantizationArgs

from pipeline.search import (
    BlockCache,
    Pricing,
    SearchParams,
    bisect,
    choose,
    effective_bits,
    mixed_recipe,
    next_k,
    pricing,
    quantized_weights,
    rtn,
    sensitivity,
    size_mib,
    top_units,
    trace,
    units,
)
from quantgate.errors import QuantgateError
from quantgate.params import read_yaml
from quantgate.recipes import bits_per_weight, least_bits_per_weight, load_recipe
from quantgate.results import BuildProfile, Screen, SearchResult, TeamScores, read_search, write_profile
from quantgate.screening import Outcome, ScreenRun
from tests.conftest import REPO
from tests.test_profile import LOAD
from tests.test_screening import comparison
from tests.tiny import WORDS, tiny_llama_dir

W4G = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16)


def test_rtn_puts_each_group_on_at_most_16_levels_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(8, 64)
    q = rtn(w, W4G)
    assert q.shape == w.shape and q.dtype == w.dtype
    for row in range(8):
        for g in range(4):
            group, qgroup = w[row, g * 16 : (g + 1) * 16], q[row, g * 16 : (g + 1) * 16]
            assert len(torch.unique(qgroup)) <= 16
            step = group.abs().max() / 7.5  # symmetric int4: scale = absmax / ((7 - (-8)) / 2)
            assert (qgroup - group).abs().max() <= step / 2 + 1e-6
    assert not torch.equal(q, w)
    assert torch.equal(rtn(torch.zeros(4, 32), W4G), torch.zeros(4, 32))


def test_rtn_refuses_a_strategy_it_cannot_fake():
    with pytest.raises(
        QuantgateError,
        match="search.recipe: weight strategy 'tensor' not supported by the search; use group or channel",
    ):
        rtn(torch.randn(4, 16), QuantizationArgs(num_bits=8, type="int", strategy="tensor"))


def test_bits_per_weight_and_effective_bits():
    g64 = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=64)
    assert bits_per_weight(g64, 576) == 4.25  # one 16-bit scale per 64 weights
    asym = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=64)
    assert bits_per_weight(asym, 576) == 4 + 20 / 64  # plus a 4-bit zero point per group
    channel = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    assert bits_per_weight(channel, 512) == 8 + 16 / 512
    layers = {"a": (300, 64), "b": (100, 64)}
    assert effective_bits(layers, set(), g64) == 4.25
    assert effective_bits(layers, {"b"}, g64) == (300 * 4.25 + 100 * 16) / 400
    assert effective_bits(layers, {"a", "b"}, g64) == 16
    # the floor validate holds search.max_bits_per_weight to, before any model exists
    assert least_bits_per_weight(g64) == 4.25 and least_bits_per_weight(asym) == 4 + 20 / 64
    assert least_bits_per_weight(channel) == 8 < bits_per_weight(channel, 100_000)


def test_size_counts_tied_weights_once(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir(tmp_path / "m"))
    all16 = sum(p.numel() for p in model.parameters()) * 2 / 2**20
    assert size_mib(model, {}, set(), W4G) == pytest.approx(all16)
    down = model.model.layers[0].mlp.down_proj
    layers = {"model.layers.0.mlp.down_proj": (down.weight.numel(), down.in_features)}
    saved = down.weight.numel() * (16 - bits_per_weight(W4G, down.in_features)) / 8 / 2**20
    assert size_mib(model, layers, set(), W4G) == pytest.approx(all16 - saved)
    assert size_mib(model, layers, set(layers), W4G) == pytest.approx(all16)


def screens_for(
    threshold: int, n: int, screens_left: int, top: int | None = None, kept_is_cheaper: bool = False
) -> list[Screen]:
    """bisect against a fake screen that passes from `threshold` kept layers on, with a budget for
    `screens_left` screens (None once it is spent) and at most `top` units kept."""
    left = [screens_left]

    def screen(k):
        if left[0] == 0:
            return None
        left[0] -= 1
        outcome = "pass" if k >= threshold else "fail"
        return Screen(
            kept=k,
            outcome=outcome,
            passed=outcome == "pass",
            worst_slack=k - threshold,
            teams={},
            effective_bits=4.0,
            seconds=0,
        )

    return bisect(n, screen, top, kept_is_cheaper)


def test_bisection_finds_the_fewest_kept_layers_within_the_budget():
    assert next_k(0, 210) == 14 and next_k(12, 14) == 13 and next_k(0, 2) == 1
    done = screens_for(13, 210, 10)
    assert [s.kept for s in done] == [0, 14, 4, 7, 10, 12, 13]  # geometric cuts: sensitivity is concentrated
    assert choose(done) == (done[-1], True)
    assert [s.kept for s in screens_for(0, 210, 10)] == [0]  # the base recipe already passes: keep none
    short = screens_for(13, 210, 3)
    assert [s.kept for s in short] == [0, 14, 4] and choose(short)[0].kept == 14
    assert screens_for(13, 210, 0) == []  # a budget that cannot start a screen: nothing screened


def test_an_undecided_screen_is_never_chosen_and_moves_the_bisection_up():
    def screen(k):
        outcome = {0: "fail", 14: "undecided"}.get(k, "pass" if k >= 30 else "undecided")
        return Screen(
            kept=k, outcome=outcome, passed=outcome == "pass", worst_slack=0.01, teams={}, effective_bits=4.0, seconds=0
        )

    done = bisect(210, screen)
    assert [(s.kept, s.outcome) for s in done][:3] == [(0, "fail"), (14, "undecided"), (54, "pass")]
    chosen, passed = choose(done)
    assert passed and chosen.kept == 30 and all(s.kept < 30 for s in done if s.outcome == "undecided")


def test_fused_layers_are_one_unit_ranked_by_their_summed_kl():
    # vLLM loads q/k/v_proj as one qkv_proj and gate/up_proj as one gate_up_proj, at one scheme: keeping
    # only q_proj 16-bit gives a build its server refuses ("different quantization schemes for the shards")
    ranking = {
        "model.layers.1.self_attn.q_proj": 0.9,
        "model.layers.0.mlp.down_proj": 0.5,
        "model.layers.1.self_attn.k_proj": 0.2,
        "model.layers.0.mlp.up_proj": 0.3,
        "model.layers.0.self_attn.o_proj": 0.25,
        "model.layers.1.self_attn.v_proj": 0.1,
        "model.layers.0.mlp.gate_proj": 0.25,
    }
    ranked = units(ranking, SearchParams().fused)
    assert ranked == [
        ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj"],
        ["model.layers.0.mlp.up_proj", "model.layers.0.mlp.gate_proj"],  # 0.55 > down_proj's 0.5
        ["model.layers.0.mlp.down_proj"],
        ["model.layers.0.self_attn.o_proj"],
    ]
    assert units(ranking, {}) == [[n] for n in sorted(ranking, key=lambda n: -ranking[n])]  # nothing fused
    # the same leaf names under another parent are another unit
    two = units({"a.q_proj": 1.0, "b.q_proj": 0.5, "a.k_proj": 0.1}, {"qkv": ["q_proj", "k_proj"]})
    assert two == [["a.q_proj", "a.k_proj"], ["b.q_proj"]]


def test_no_passing_screen_keeps_no_layer_16_bit():
    # an unproven candidate is not a build: int4-mixed is then the base recipe's (int4's weights, reused)
    done = screens_for(500, 210, 3)  # nothing short of every layer passes
    assert [s.kept for s in done] == [0, 14, 54] and not any(s.passed for s in done)
    assert choose(done) == (None, False)


def test_where_a_kept_layer_is_cheaper_only_the_most_kept_candidate_is_screened():
    # vLLM CPU's W4A16 measured slower than its bfloat16 GEMMs: each kept layer lowers the cost per token, so
    # the cheapest candidate is the bound's; if it does not pass, fewer kept layers do not either
    assert [(s.kept, s.passed) for s in screens_for(13, 210, 10, top=40, kept_is_cheaper=True)] == [(40, True)]
    assert [(s.kept, s.passed) for s in screens_for(50, 210, 10, top=40, kept_is_cheaper=True)] == [(40, False)]
    assert [s.kept for s in screens_for(13, 210, 10, kept_is_cheaper=True)] == [209]  # no bound: all but one
    assert [s.kept for s in screens_for(13, 210, 10, top=210, kept_is_cheaper=True)] == [209]  # never all 16-bit
    assert screens_for(13, 210, 0, top=40, kept_is_cheaper=True) == []
    assert screens_for(13, 210, 10, top=0, kept_is_cheaper=True) == []  # the bound holds the base recipe only


def test_the_cheapest_passing_screen_is_chosen_by_its_estimated_cost():
    def s(kept, passed, ratio):
        return Screen(kept=kept, passed=passed, worst_slack=0, teams={}, effective_bits=4.0, seconds=0, est_ratio=ratio)

    assert choose([s(0, False, 1.78), s(20, True, 1.7), s(40, True, 1.6)])[0].kept == 40
    assert choose([s(0, False, 0.6), s(20, True, 0.7), s(40, True, 0.8)])[0].kept == 20
    assert choose([s(0, False, None), s(40, True, None), s(14, True, None)])[0].kept == 14  # by bits: fewest kept


def profile_at(path, build, tokens_per_s, status="profiled"):
    load = LOAD.model_copy(update={"concurrency": 8, "output_tokens_per_s": tokens_per_s})
    small = LOAD.model_copy(update={"output_tokens_per_s": 1000.0})  # at concurrency 1: not the load priced
    profile = BuildProfile(build=build, status=status, input_len=256, output_len=64, seed=0)
    if status == "profiled":
        profile = profile.model_copy(update={"loads": {"c1": small, "c8": load}})
    else:
        profile = profile.model_copy(update={"reason": "vLLM here cannot serve W4A16"})
    write_profile(path / f"{build}.json", profile)


def test_candidates_are_priced_from_the_16_bit_and_base_builds_measured_throughput(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(
        "quantize:\n  int4: {recipe: recipes/int4.yaml}\n  int4-mixed: {recipe: results/search/recipe.yaml}\n"
    )
    builds, p = ["fp16", "int4", "int4-mixed"], SearchParams()
    profile_at(tmp_path, "fp16", 125.0)
    profile_at(tmp_path, "int4", 80.0)
    price = pricing(tmp_path, p, builds)
    assert price.measured and price.kept_is_cheaper and price.concurrency == 8  # int4 the slower at 8 in flight
    assert price.ratio(0.0) == 1.0 and price.ratio(1.0) == pytest.approx(125 / 80)
    assert price.ratio(0.5) == pytest.approx((1 + 125 / 80) / 2)  # halfway in seconds per token, not in tokens/s
    assert "fp16.json and" in price.source
    assert "125.0 and 80.0 output tokens/s per device at 8 in flight" in price.source
    profile_at(tmp_path, "int4", 250.0)  # a GPU: the quantized build the faster
    faster = pricing(tmp_path, p, builds)
    assert faster.kept_is_dearer and not faster.kept_is_cheaper
    profile_at(tmp_path, "int4", 118.0)  # within search.min_speed_difference (15 %) of fp16: no measured order
    close = pricing(tmp_path, p, builds)
    assert close.measured and not close.kept_is_cheaper and not close.kept_is_dearer


@pytest.mark.parametrize(
    "fp16, int4, why",
    [
        ("", None, "fp16.json unreadable"),
        (None, "unprofiled", "int4 has no measured load (vLLM here cannot serve W4A16)"),
        (None, 0.0, "int4.json: the profile measured no output tokens at [8] in flight"),
        (None, float("nan"), "int4.json: the profile measured no output tokens at [8] in flight"),
        (None, float("inf"), "int4.json: the profile measured no output tokens at [8] in flight"),
        (None, "int8", "int4.json holds build int8's profile, not int4's"),
        (None, "c2 only", "fp16 and int4 were profiled at different concurrencies ([1, 8] vs [2])"),
    ],
)
def test_profiles_that_cannot_price_fall_back_to_bits_with_a_true_reason(tmp_path, monkeypatch, fp16, int4, why):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("quantize:\n  int4: {recipe: recipes/int4.yaml}\n")
    profile_at(tmp_path, "fp16", 125.0)
    if fp16 == "":
        (tmp_path / "fp16.json").write_text("")
    if int4 == "unprofiled":
        profile_at(tmp_path, "int4", 0, status="unprofiled")
    elif int4 == "int8":
        profile_at(tmp_path, "int8", 80.0)
        (tmp_path / "int8.json").rename(tmp_path / "int4.json")
    elif int4 == "c2 only":
        c2 = {"c2": LOAD.model_copy(update={"concurrency": 2})}
        only = BuildProfile(build="int4", status="profiled", input_len=256, output_len=64, seed=0, loads=c2)
        write_profile(tmp_path / "int4.json", only)
    else:
        profile_at(tmp_path, "int4", 80.0 if int4 is None else int4)
    price = pricing(tmp_path, SearchParams(), ["fp16", "int4", "int4-mixed"])
    assert not price.measured and price.ratio(0.5) is None and not price.kept_is_cheaper
    assert why in price.source


def test_a_search_base_that_is_no_build_or_another_recipes_build_prices_nothing_or_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("quantize:\n  int4-mixed: {recipe: results/search/recipe.yaml}\n")
    p = SearchParams()
    assert pricing(tmp_path, p, ["fp16", "int4-mixed"]).source == "search.base int4 is not a build of this run"
    with pytest.raises(QuantgateError, match=r"params.yaml: search.base int4-mixed is made with results/search/"):
        pricing(tmp_path, SearchParams(base="int4-mixed"), ["fp16", "int4-mixed"])


def test_the_bits_bound_is_screened_second_and_ends_the_search_when_it_does_not_pass():
    # 40 units fit under max_bits_per_weight: 40 is screened right after 0
    assert [s.kept for s in screens_for(500, 210, 10, top=40)] == [0, 40]  # nothing within the bound passes
    assert [s.kept for s in screens_for(13, 210, 10, top=40)] == [0, 40, 6, 15, 9, 12, 13]
    assert choose(screens_for(13, 210, 10, top=40))[0].kept == 13
    assert [s.kept for s in screens_for(13, 210, 10, top=0)] == [0]  # the bound holds the base recipe only
    assert [s.kept for s in screens_for(13, 210, 10, top=210)] == [0, 14, 4, 7, 10, 12, 13]  # no bound in effect
    assert [s.kept for s in screens_for(500, 210, 1, top=40)] == [0]  # the budget ends first


def test_top_units_is_the_most_kept_within_the_bound_and_refuses_a_bound_below_the_base():
    bits = [4.25, 4.9, 5.6, 6.0, 6.7, 16.0]
    assert top_units(bits, 6.0) == 3 and top_units(bits, 4.25) == 0 and top_units(bits, None) is None
    with pytest.raises(QuantgateError, match=r"search.max_bits_per_weight 4 is below the base recipe's own 4.25 bits"):
        top_units(bits, 4.0)


def test_old_search_keys_are_refused_with_what_replaced_them():
    with pytest.raises(ValueError, match=r"search.max_evals was replaced: the search spends search.doc_budget"):
        SearchParams(max_evals=4)
    with pytest.raises(ValueError, match=r"search.screen_limit was replaced: each screen looks at search.looks"):
        SearchParams(screen_limit=40)
    with pytest.raises(ValueError, match=r"looks must be growing document counts above 0"):
        SearchParams(looks=[80, 40])


def test_mixed_recipe_adds_the_kept_layers_to_ignore_and_llm_compressor_reads_it(tmp_path):
    base = tmp_path / "int4.yaml"
    base.write_text(
        "quant_stage:\n  quant_modifiers:\n    GPTQModifier:\n      ignore: [lm_head]\n      config_groups:\n"
        "        group_0:\n          targets: [Linear]\n          weights: {num_bits: 4, type: int, symmetric: true,"
        " strategy: group, group_size: 64}\n"
    )
    out = tmp_path / "mixed.yaml"
    out.write_text(mixed_recipe(base, ["model.layers.3.mlp.down_proj", "model.layers.0.self_attn.q_proj"], "a\nb"))
    assert out.read_text().startswith("# a\n# b\n")
    recipe = load_recipe("int4-mixed", out)
    assert recipe.modifiers[0].ignore == ["lm_head", "model.layers.3.mlp.down_proj", "model.layers.0.self_attn.q_proj"]


def test_sensitivity_ranks_every_layer_restores_the_weights_and_scores_an_exact_layer_zero(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir(tmp_path / "m"), dtype=torch.float32).eval()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    exact = "model.layers.1.mlp.up_proj"
    with torch.no_grad():
        linears[exact].weight.zero_()  # zeros are exact in int4: quantizing it changes nothing
    before = {n: m.weight.clone() for n, m in linears.items()}
    batches = [torch.tensor([[3, 4, 5, 9, 6, 8, 2, 7, 10, 11, 12, 13, 3, 4, 5, 9]])]
    ranking = sensitivity(model, linears, quantized_weights(model, linears, W4G, []), batches)
    assert set(ranking) == set(linears) and len(ranking) == 2 * 7
    values = list(ranking.values())
    assert values == sorted(values, reverse=True) and values[0] > 0
    assert ranking[exact] == pytest.approx(0.0, abs=1e-7) and values[0] > 1e3 * max(ranking[exact], 1e-9)
    assert all(v >= -1e-7 and math.isfinite(v) for v in values)
    assert all(torch.equal(before[n], m.weight) for n, m in linears.items())


def test_a_pass_started_at_any_block_gives_the_full_forward_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir(tmp_path / "m"), dtype=torch.float32).eval()
    batches = [torch.tensor([[3, 4, 5, 9, 6, 8]]), torch.tensor([[7, 10, 11, 12, 2, 3, 4, 5]])]
    cache = BlockCache(model, batches)
    assert cache.start_of("model.layers.1.mlp.down_proj") == 1 and cache.start_of("lm_head") == 0
    with torch.no_grad():
        for b, ids in enumerate(batches):
            full = model(input_ids=ids, use_cache=False).logits
            assert torch.allclose(cache.reference[b], full, atol=1e-5)  # the recording pass is the reference
            for start in (0, 1):
                assert torch.allclose(cache.logits(b, start), full, atol=1e-5)
            down = model.model.layers[1].mlp.down_proj
            saved = down.weight.data.clone()
            down.weight.data = saved * 3  # a change in block 1 shows in a pass started there
            assert torch.allclose(cache.logits(b, 1), model(input_ids=ids, use_cache=False).logits, atol=1e-5)
            assert not torch.allclose(cache.logits(b, 1), full, atol=1e-5)
            down.weight.data = saved


@pytest.mark.parametrize(
    "quantize, builds, message",
    [
        (
            "int4-mixed: {recipe: recipes/int4.yaml}",
            ["fp16", "int4-mixed"],
            r"search.build int4-mixed is a build, so quantize.int4-mixed.recipe must be results/search/recipe.yaml",
        ),
        (
            "int4_mixed: {recipe: results/search/recipe.yaml}",
            ["fp16", "int4_mixed"],
            r"quantize.int4_mixed.recipe is results/search/recipe.yaml, which the search writes for search.build "
            r"\(int4-mixed\) only; set search.build: int4_mixed",
        ),
    ],
)
def test_validate_refuses_a_search_build_that_does_not_read_the_search_recipe(tmp_path, quantize, builds, message):
    from pipeline.validate import check_search

    params = tmp_path / "params.yaml"
    params.write_text(
        f"search:\n  build: int4-mixed\n  base: int4\n  recipe: recipes/int4.yaml\nquantize:\n  {quantize}\n"
    )
    with pytest.raises(QuantgateError, match=message):
        check_search(builds, params)
    params.write_text(
        "search:\n  build: int4-mixed\n  base: int4\n  recipe: recipes/int4.yaml\nquantize:\n"
        "  int4-mixed: {recipe: results/search/recipe.yaml}\n"
        "  int4: {recipe: recipes/int4.yaml}\n"
    )
    check_search(["fp16", "int4", "int4-mixed"], params)  # the default pairing
    params.write_text("search:\n  build: int4-mixed\n  base: fp16\n  recipe: recipes/int4.yaml\nquantize: {}\n")
    check_search(["fp16"], params)  # the search build dropped (its block too: load_builds); base any build


def test_validate_refuses_a_search_base_that_is_no_build_or_another_recipes(tmp_path):
    from pipeline.validate import check_search

    params = tmp_path / "params.yaml"
    head = "search: {build: int4-mixed, recipe: ./recipes/int4.yaml, base: int4}\nquantize:\n"
    mixed = "  int4-mixed: {recipe: results/search/recipe.yaml}\n"
    params.write_text(head + mixed + "  int4: {recipe: recipes/int4.yaml}\n")
    check_search(["fp16", "int4", "int4-mixed"], params)  # the default pairing, paths compared as paths
    with pytest.raises(QuantgateError, match=r"params.yaml:\d+: search.base int4 is not in builds: it names"):
        check_search(["fp16", "int4-mixed"], params)
    with pytest.raises(QuantgateError, match=r"search.base int4 is not in builds: .* even when the search is skipped"):
        check_search(["fp16", "int8"], params)  # dvc.yaml still reads its profile
    params.write_text(head + mixed + "  int4: {recipe: recipes/sweep/int4_gptq_g64.yaml}\n")
    with pytest.raises(QuantgateError, match=r"search.base int4 is made with recipes/sweep/int4_gptq_g64.yaml"):
        check_search(["fp16", "int4", "int4-mixed"], params)
    check_search(["fp16", "int4"], params)  # no search build: any build prices nothing
    for base, why in (("null", "is missing"), ("fp16", "fp16 is the 16-bit build")):
        params.write_text(
            f"search: {{build: int4-mixed, base: {base}, recipe: recipes/int4.yaml}}\nquantize:\n" + mixed
        )
        with pytest.raises(QuantgateError, match=f"search.base {why}"):
            check_search(["fp16", "int4-mixed"], params)


@pytest.mark.parametrize(
    "line, message",
    [
        ("lookz: [40, 80]", r"search.lookz"),
        ("looks: [80, 40]", r"search.looks.*growing document counts"),
        ("max_evals: 4", r"search.max_evals was replaced: the search spends search.doc_budget"),
        ("doc_budget: 0", r"search.doc_budget"),
    ],
)
def test_validate_reads_every_key_of_the_search_block_as_the_search_stage_does(tmp_path, line, message):
    from pipeline.validate import check_search

    params = tmp_path / "params.yaml"
    params.write_text(
        f"search:\n  base: int4\n  recipe: recipes/int4.yaml\n  {line}\nquantize:\n"
        "  int4-mixed: {recipe: results/search/recipe.yaml}\n"
        "  int4: {recipe: recipes/int4.yaml}\n"
    )
    with pytest.raises(QuantgateError, match=message) as err:
        check_search(["fp16", "int4", "int4-mixed"], params)
    assert str(err.value).startswith(f"{params}") and "\n" not in str(err.value).strip()


def fake_screened_search(tmp_path, monkeypatch, example_evals, outcome: Outcome, price=None, **params):
    """The search run on a tiny Llama (real ranking, recipe and outs) with screens that all end in `outcome`
    after 40 documents. Returns (out dir, result, [k screened, in order])."""
    import pipeline.search as search_stage

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    doc = read_yaml(REPO / "params.yaml")
    doc["quantize"]["int4-mixed"]["calibration"] |= {"samples": 2, "seq_len": 16}  # the imatrix statistics
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    (tmp_path / "results").mkdir()
    text = " ".join(WORDS[3:] * 2)
    (tmp_path / "results/calibration.jsonl").write_text(f'{{"text": "{text}"}}\n' * 2)

    def screen_teams(lm, teams, harness, baseline, gate, p, budget):
        budget.spent += 40
        verdict = outcome.value.upper()
        return ScreenRun(outcome, {"billing": comparison(verdict, 40)}, docs=40, trail=[f"40: billing {verdict}"])

    monkeypatch.setattr(search_stage, "hf_lm", lambda *a, **k: None)
    monkeypatch.setattr(search_stage, "run_team", lambda lm, team, harness: (TeamScores(status="ok"), None))
    monkeypatch.setattr(search_stage, "screen_teams", screen_teams)
    p = SearchParams(recipe=str(REPO / "recipes/int4.yaml"), kl_samples=2, kl_seq_len=16, **params)
    out = tmp_path / "results/search"
    result = search_stage.search(tiny_llama_dir(tmp_path / "tiny"), example_evals, out, p, price)
    return out, result, [x.kept for x in result.screens]


@pytest.fixture
def kept_none(tmp_path, monkeypatch, example_evals):
    """fake_screened_search with a screen that passes at once, at k = 0: the base recipe, no layer kept."""
    return fake_screened_search(tmp_path, monkeypatch, example_evals, Outcome.PASS)


def test_a_search_where_nothing_within_the_bits_bound_passes_screens_twice_and_keeps_no_layer(
    tmp_path, monkeypatch, example_evals
):
    out, result, screens = fake_screened_search(
        tmp_path, monkeypatch, example_evals, Outcome.FAIL, max_bits_per_weight=8.0
    )
    # the tiny Llama's 14 layers: at most 8 bits per weight keeps result.max_kept of them, screened second
    assert screens == [0, result.max_kept] and 0 < result.max_kept < 14
    assert result.screens[1].effective_bits <= 8.0
    assert 0 <= result.screens[0].size_mib <= result.screens[1].size_mib  # each candidate's estimated weights
    assert f"| 0 | 4.25 | {result.screens[0].size_mib:.1f} |" in (out / "trace.md").read_text()
    assert (result.passed, result.chosen, result.kept_layers, result.effective_bits) == (False, 0, [], 4.25)
    assert load_recipe("int4-mixed", out / "recipe.yaml").modifiers[0].ignore == ["lm_head"]  # int4's recipe
    trace = (out / "trace.md").read_text()
    assert f"at most 8 bits per weight (search.max_bits_per_weight): at most {result.max_kept} layers" in trace
    assert "no screened candidate was shown to pass: the base recipe's build, which the gate FAILs" in trace


def test_a_bits_bound_below_the_base_recipe_is_refused_before_the_ranking(tmp_path, monkeypatch, example_evals):
    with pytest.raises(
        QuantgateError, match=r"search.max_bits_per_weight 4 is below the base recipe's own 4.25"
    ) as err:
        fake_screened_search(tmp_path, monkeypatch, example_evals, Outcome.FAIL, max_bits_per_weight=4.0)
    line = next(i for i, t in enumerate((tmp_path / "params.yaml").read_text().splitlines(), 1) if "max_bits" in t)
    assert str(err.value).startswith(f"params.yaml:{line}: search.max_bits_per_weight 4 is below")  # as check_bound's


def test_a_search_whose_first_screen_passes_keeps_no_layer_and_writes_the_base_recipe(kept_none):
    out, result, screens = kept_none
    assert screens == [0]  # k = 0 screened, nothing after it
    assert (result.build, result.passed, result.chosen, result.kept_layers) == ("int4-mixed", True, 0, [])
    assert result.layers == 14 and result.evaluations == 1 and result.effective_bits == 4.25
    assert (result.docs_spent, result.doc_budget, result.screens[0].looks) == (40, 1500, ["40: billing PASS"])
    assert result.ranked_on.startswith("the first 2 conversations of results/calibration.jsonl (<= 16 tokens")
    assert read_search(out / "search.json") == result
    written, base = read_yaml(out / "recipe.yaml"), read_yaml(REPO / "recipes/int4.yaml")
    assert written == base  # the base recipe's ignore, no layer added
    assert load_recipe("int4-mixed", out / "recipe.yaml").modifiers[0].ignore == ["lm_head"]
    assert "Kept: none" in (out / "trace.md").read_text()


@pytest.mark.parametrize("cheaper", [False, True])
def test_a_bits_bound_that_allows_no_kept_unit_is_refused_before_the_ranking(
    tmp_path, monkeypatch, example_evals, cheaper
):
    """A bound between the base recipe's bits and the bits with the smallest unit kept: the search ranked every
    layer and screened the base recipe alone (or, kept layers being cheaper, said so after the ranking)."""
    import pipeline.search as search_stage

    price = Pricing(baseline_s=1 / 125, quantized_s=1 / 80, concurrency=8, source="fp16.json and int4.json")
    monkeypatch.setattr(search_stage, "sensitivity", lambda *a: pytest.fail("ranked before refusing"))
    with pytest.raises(QuantgateError) as err:  # not the document budget's message: nothing was screened
        fake_screened_search(
            tmp_path, monkeypatch, example_evals, Outcome.PASS, price if cheaper else None, max_bits_per_weight=4.26
        )
    line = next(i for i, t in enumerate((tmp_path / "params.yaml").read_text().splitlines(), 1) if "max_bits" in t)
    found = re.fullmatch(
        rf"params.yaml:{line}: search.max_bits_per_weight 4.26 allows no layer kept 16-bit \(the base recipe is 4.25 "
        r"bits per weight, the smallest unit kept makes (\d+\.\d\d)\), so int4-mixed could only be int4's recipe "
        r"again; raise it to at least (\d+\.\d\d), set it to null, or drop int4-mixed from builds",
        str(err.value),
    )
    assert found, err.value
    one, least = map(float, found.groups())
    assert 4.26 < one <= least < one + 0.011  # rounded up: a bound of `least` keeps the smallest unit


@pytest.mark.parametrize("outcome", [Outcome.PASS, Outcome.FAIL])
def test_a_search_priced_where_kept_layers_are_cheaper_screens_the_bounds_candidate_alone(
    tmp_path, monkeypatch, example_evals, outcome
):
    price = Pricing(baseline_s=1 / 125, quantized_s=1 / 80, concurrency=8, source="fp16.json and int4.json")
    out, result, screens = fake_screened_search(
        tmp_path, monkeypatch, example_evals, outcome, price, max_bits_per_weight=8.0
    )
    assert screens == [result.max_kept] and 0 < result.max_kept < 14 and result.kept_is_cheaper
    s = result.screens[0]
    assert 1.0 < s.est_ratio < 125 / 80 and len(s.layers) == result.max_kept  # between fp16's and int4's
    trace = (out / "trace.md").read_text()
    assert "the quantized kernel is the slower one here" in trace and f"| {s.est_ratio:.2f}x |" in trace
    assert f"still costs more per output token than the 16-bit build here (at least {s.est_ratio:.2f}x)" in trace
    if outcome is Outcome.PASS:
        assert (result.passed, result.chosen, result.est_ratio, result.kept_layers) == (
            True,
            result.max_kept,
            s.est_ratio,
            s.layers,
        )
        ignore = load_recipe("int4-mixed", out / "recipe.yaml").modifiers[0].ignore
        assert ignore == ["lm_head", *result.kept_layers]
    else:  # nothing passes: no layer kept, priced as the base build itself
        assert (result.passed, result.chosen, result.kept_layers) == (False, 0, [])
        assert result.est_ratio == pytest.approx(1.5625)


def test_two_builds_of_a_search_that_kept_no_layer_go_through_gate_and_register(kept_none, example_evals):
    """int4-mixed made from that recipe is int4's weights: the gate says so, register keeps a run for each."""
    from pipeline.gate import build_line
    from pipeline.register import RegisterParams, register
    from registry import store
    from tests.test_register import TEAMS, gate_twins, runs_by_build

    out, search, _ = kept_none
    root = out.parents[1]
    result = gate_twins(root, example_evals, search)
    int4, mixed = result.builds["int4"], result.builds["int4-mixed"]
    assert (int4.verdict, mixed.verdict) == ("INCONCLUSIVE", "INCONCLUSIVE") and mixed.reason is None
    assert mixed.same_weights_as == "int4" and int4.same_weights_as is None
    line = build_line("int4-mixed", mixed, search)
    assert line == "int4-mixed: INCONCLUSIVE; same weights as int4 (the search kept no layer 16-bit)"
    params = RegisterParams(model_name="tiny", experiment="e")
    first = register(root / "models", result, "# r", root / "results/eval", params, TEAMS)
    again = register(root / "models", result, "# r", root / "results/eval", params, TEAMS)
    assert again["unregistered"] == {b: {**e, "reused": True} for b, e in first["unregistered"].items()}
    found = runs_by_build(store.client())
    assert {b: len(r) for b, r in found.items()} == {"fp16": 1, "int4": 1, "int4-mixed": 1}
    assert found["int4-mixed"][0].data.tags["same_weights_as"] == "int4"
    assert "same_weights_as" not in found["int4"][0].data.tags


def test_the_trace_has_a_column_for_every_team_any_screen_looked_at():
    # a screen stops at the first team that FAILs: the base recipe's looked at billing only
    first = Screen(
        kept=0, outcome="fail", passed=False, worst_slack=-0.2, teams={"billing": comparison("FAIL", 40)},
        effective_bits=4.25, size_mib=107.9, seconds=7, docs=40, looks=["40: billing FAIL"],
    )  # fmt: skip
    both = {"billing": comparison("FAIL", 160), "search": comparison("PASS", 80)}
    second = first.model_copy(update={"kept": 51, "teams": both, "effective_bits": 5.99, "size_mib": 147.2})
    result = SearchResult(build="int4-mixed", recipe="recipes/int4.yaml", screens=[first, second], chosen=0)
    lines = trace(result, SearchParams()).splitlines()
    header = next(line for line in lines if line.startswith("| kept 16-bit"))
    assert "billing drop / margin (n) | search drop / margin (n)" in header
    row = next(line for line in lines if line.startswith("| 0 | 4.25 | 107.9 |"))
    assert row.split(" | ")[4:6] == ["+0.000 / 0.080 (FAIL, 40)", "not looked at"]  # after the cost column ("-")


def test_the_recipes_imatrix_observer_is_what_candidates_are_quantized_with(tmp_path):
    """int4's recipe picks each group's scale by imatrix_mse (error weighted by E[x^2] of its input channels):
    the search's candidates must be quantized that way too, not by min-max, which loses about twice as much."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir(tmp_path / "m"), dtype=torch.float32).eval()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    batches = [torch.tensor([[3, 4, 5, 9, 6, 8, 2, 7, 10, 11, 12, 13, 3, 4, 5, 9]]), torch.tensor([[7, 3, 2, 9, 4]])]
    imatrix = W4G.model_copy(update={"observer": "imatrix_mse"})
    before = {n: m.weight.clone() for n, m in linears.items()}
    observed = quantized_weights(model, linears, imatrix, batches)
    minmax = quantized_weights(model, linears, W4G, [])
    assert all(torch.equal(before[n], m.weight) for n, m in linears.items())  # nothing changed in place
    inputs = {}
    hooks = [
        m.register_forward_pre_hook(lambda m, a, n=n: inputs.setdefault(n, []).append(a[0])) for n, m in linears.items()
    ]
    with torch.no_grad():
        for ids in batches:
            model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    differs = 0
    for name, m in linears.items():
        w, q = m.weight.data, observed[name]
        assert q.shape == w.shape and q.dtype == w.dtype
        groups = q.reshape(q.shape[0], -1, W4G.group_size)
        assert max(len(torch.unique(g)) for g in groups.reshape(-1, W4G.group_size)) <= 16  # 4-bit levels per group
        x2 = torch.cat([x.reshape(-1, x.shape[-1]) for x in inputs[name]]).pow(2).mean(0)  # E[x^2] per input channel
        error = {k: float(((qq - w).abs().pow(3) * x2).sum()) for k, qq in (("imatrix", q), ("minmax", minmax[name]))}
        assert error["imatrix"] <= error["minmax"] * (1 + 1e-5)  # the observer's own objective (norm 3)
        differs += not torch.equal(q, minmax[name])
    assert differs > 0  # the grid search moved some group's scale off min-max


@pytest.mark.parametrize("cheaper", [False, True])
def test_a_bits_bound_the_top_ranked_unit_is_over_is_refused_after_the_ranking_naming_it(
    tmp_path, monkeypatch, example_evals, cheaper
):
    """A bound above the smallest unit (an o_proj: 4.90 bits) but below the unit the ranking puts first (layer 1's
    gate+up: 6.86 bits) passes check_bound, since which unit is first is known only after the ranking. The search
    then screened the base recipe alone and wrote it as int4-mixed ("at most 0 layers kept"), or, kept layers being
    cheaper, said so without the bound's line or the least bound that would keep that unit."""
    import pipeline.search as search_stage

    def sensitivity(model, linears, quantized, batches):  # layer 1's MLP most sensitive, then the rest
        first = ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]
        return {n: 1.0 for n in first} | {n: 0.01 for n in linears if n not in first}

    price = Pricing(baseline_s=1 / 125, quantized_s=1 / 80, concurrency=8, source="fp16.json and int4.json")
    monkeypatch.setattr(search_stage, "sensitivity", sensitivity)
    with pytest.raises(QuantgateError) as err:
        fake_screened_search(
            tmp_path, monkeypatch, example_evals, Outcome.FAIL, price if cheaper else None, max_bits_per_weight=5.0
        )
    line = next(i for i, t in enumerate((tmp_path / "params.yaml").read_text().splitlines(), 1) if "max_bits" in t)
    assert str(err.value) == (
        f"params.yaml:{line}: search.max_bits_per_weight 5 allows no layer kept 16-bit (the base recipe is 4.25 bits "
        "per weight, the unit ranked first (model.layers.1.mlp.gate_proj+model.layers.1.mlp.up_proj) kept makes "
        "6.86), so int4-mixed could only be int4's recipe again; raise it to at least 6.87, set it to null, or drop "
        "int4-mixed from builds"
    )
    assert not (tmp_path / "results/search").exists()  # no screen, no recipe written
