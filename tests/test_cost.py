"""The KV-cache and capacity arithmetic of quantgate/cost.py against the design chapter's worked
example (a 7B-class GQA model) and against vLLM's own report for the default model."""

import pytest

from quantgate.cost import (
    GB,
    CostParams,
    KVShape,
    check_context,
    devices_for,
    in_flight,
    kv_bytes_per_token,
    kv_capacity_tokens,
    kv_dtype_bytes,
    mixed_seconds_per_token,
    requests_per_device,
    usd_per_million_tokens,
)
from quantgate.errors import QuantgateError
from quantgate.params import load_block

# 32 layers, 32 query heads, 8 KV heads, head dim 128 (the chapter's 7B-class GQA model)
SEVEN_B = KVShape.from_config(
    {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
)
# SmolLM2-135M-Instruct's config.json (models/fp16/config.json)
SMOLLM2 = KVShape.from_config(
    {
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "hidden_size": 576,
        "head_dim": 64,
        "max_position_embeddings": 8192,
    }
)


def test_worked_example_kv_per_request_and_the_query_head_trap():
    per_token = kv_bytes_per_token(SEVEN_B, 2)
    assert per_token == 131_072
    assert round(per_token * 4096 / GB, 2) == 0.54
    assert round(16 * per_token * 4096 / GB, 2) == 8.59
    wrong = kv_bytes_per_token(SEVEN_B, 2, heads="query")
    assert round(16 * wrong * 4096 / GB, 1) == 34.4 and wrong == 4 * per_token


def test_worked_example_requests_per_device_little_and_devices():
    per_request = kv_bytes_per_token(SEVEN_B, 2) * 4096
    fit = requests_per_device(80 * GB, 16 * GB, 0.9, per_request)
    assert fit == 104
    flying = in_flight(50, 0.350, 250, 0.022)
    assert flying == pytest.approx(292.5) and int(flying) == 292
    d = devices_for(flying, fit, batch_cap=32, utilization=0.8)
    assert (d.memory, d.batch, d.needed, d.bound) == (4, 12, 12, "batch cap")


def test_default_model_capacity_matches_vllms_report():
    """vLLM CPU at float32 with VLLM_CPU_KVCACHE_SPACE=2 GiB logged "CPU KV cache size: 46,592 tokens"
    (results/eval/fp16/server.log; issue 17 measured 186,368 at fp8 KV on AVX512)."""
    f32 = kv_capacity_tokens(2 * 2**30, kv_bytes_per_token(SMOLLM2, kv_dtype_bytes("auto", "float32")))
    assert f32 == 46_603 and abs(f32 - 46_592) / 46_592 < 0.01
    fp8 = kv_capacity_tokens(2 * 2**30, kv_bytes_per_token(SMOLLM2, kv_dtype_bytes("fp8", "bfloat16")))
    assert kv_bytes_per_token(SMOLLM2, 1) == 30 * 3 * 64 * 2 and abs(fp8 - 186_368) / 186_368 < 0.01


def test_cost_per_million_tokens():
    assert usd_per_million_tokens(2.0, 1000) == pytest.approx(2.0 / 3.6)
    with pytest.raises(QuantgateError, match="throughput must be > 0"):
        usd_per_million_tokens(2.0, 0)


def test_a_mixed_builds_time_per_token_is_linear_in_its_quantized_weight_share():
    # the demo's profiles on AVX512+bf16 (README): fp16 135.5, int4 82.4 output tokens/s at 8 in flight
    fp16, int4 = 1 / 135.5, 1 / 82.4
    assert mixed_seconds_per_token(fp16, int4, 0.0) == fp16 and mixed_seconds_per_token(fp16, int4, 1.0) == int4
    half = mixed_seconds_per_token(fp16, int4, 0.5)
    assert half == pytest.approx((fp16 + int4) / 2) and 1 / half == pytest.approx(102.5, abs=0.05)  # the harmonic mean
    for bad, args in (("within 0..1", (fp16, int4, 1.5)), ("must be > 0", (0.0, int4, 0.5))):
        with pytest.raises(QuantgateError, match=bad):
            mixed_seconds_per_token(*args)


def test_bad_inputs_name_the_field(tmp_path):
    with pytest.raises(QuantgateError, match="kv_cache_dtype: 'int3' is not one of auto"):
        kv_dtype_bytes("int3", "float32")
    bad = tmp_path / "params.yaml"
    bad.write_text("cost:\n  gpu_hour_usd: -1\n")
    with pytest.raises(QuantgateError, match=r"params.yaml:2: cost.gpu_hour_usd"):
        load_block("cost", CostParams, bad)
    with pytest.raises(QuantgateError, match=r"cost.context_tokens: 9000 tokens is longer than the model's context"):
        check_context(CostParams(context_tokens=9000), SMOLLM2)
    with pytest.raises(QuantgateError, match="no request fits"):
        devices_for(10, 0, 32, 0.8)
    with pytest.raises(
        QuantgateError, match=r"^config\.json: num_hidden_layers missing or not an integer; cannot size the KV cache$"
    ):
        KVShape.from_config({"num_attention_heads": 9})
