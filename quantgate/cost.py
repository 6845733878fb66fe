"""What a build costs to serve: KV-cache arithmetic, requests per device, devices for a load, $ per 1M tokens.

Pure arithmetic from a model's config, the serving precision and the `cost` params block; the
profile of a build (measured throughput and vLLM's own KV capacity) plugs into it. Units: bytes,
GB = 1e9 bytes (the chapter's unit), GiB = 2**30 bytes (vLLM's), seconds, tokens, USD.
Source of every rule: the design chapter (../shared/DESIGN.md, "what quantization buys"), with
its worked example reproduced in tests/test_cost.py:
- KV bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per element. The KV heads,
  not the query heads: with grouped-query attention (GQA) counting query heads makes the cache
  n_heads / n_kv_heads times too large (4x for 32 query / 8 KV heads).
- Requests per device = floor((device memory x usable fraction - weights) / KV bytes per request).
- In flight = QPS x residence (Little's law), residence = TTFT + output tokens x TPOT.
- Devices = the larger of in flight / (requests per device x utilization) (memory bound) and
  in flight / (batch cap x utilization) (the scheduler's running-batch cap), each rounded up.
- $ per 1M output tokens = device-hour price / (3600 x output tokens per second per device) x 1e6.
- A mixed build's seconds per output token, before it is profiled: linear in the share of the targeted weights
  quantized, between the 16-bit build's and the fully quantized build's measured figures (mixed_seconds_per_token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import Field, ValidationInfo, field_validator

from quantgate.errors import QuantgateError
from quantgate.params import Frozen
from quantgate.precision import attention_heads

GB = 1e9
# bytes per KV element: vLLM's --kv-cache-dtype values ("auto" = the serving dtype's own)
KV_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "bfloat16": 2, "float16": 2, "half": 2, "float32": 4}


class CostParams(Frozen):
    """params.yaml block `cost`: the load and the price a release is judged at."""

    gpu_hour_usd: float = Field(default=2.0, gt=0)  # price of one device (or CPU node) for an hour; 0 has no ratio
    qps: float = Field(default=50, gt=0)  # requests per second to serve
    context_tokens: int = Field(default=2048, gt=0)  # prompt + output tokens one request holds in KV
    output_tokens: int = Field(default=250, gt=0)  # generated tokens per request
    batch_cap: int = Field(default=32, gt=0)  # the engine's running-batch cap (vLLM --max-num-seqs)
    utilization: float = Field(default=0.8, gt=0, le=1)  # planned load per device: the headroom
    usable_memory_fraction: float = Field(default=0.9, gt=0, le=1)  # vLLM --gpu-memory-utilization

    @field_validator("output_tokens")
    @classmethod
    def _within_context(cls, value: int, info: ValidationInfo) -> int:
        """Raises ValueError unless the output fits the context with a prompt: context_tokens counts a request's
        prompt (at least one token) and its output, so a context of no more than the output sizes no request."""
        context = info.data.get("context_tokens")
        if isinstance(context, int) and value >= context:
            raise ValueError(
                f"{value} tokens is not less than cost.context_tokens ({context}), which counts the prompt and these "
                "output tokens of one request; lower output_tokens or raise context_tokens"
            )
        return value


@dataclass(frozen=True)
class KVShape:
    """What sizes one token of KV cache: layers, KV heads, head dim (from a HF config.json)."""

    layers: int
    kv_heads: int
    head_dim: int
    query_heads: int
    max_context: int | None = None

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> KVShape:
        """From a Hugging Face config dict; KV heads default to the query heads (no GQA) only when
        the config has no num_key_value_heads. Raises QuantgateError naming the missing field."""
        for key in ("num_hidden_layers", "num_attention_heads"):
            if not isinstance(config.get(key), int):
                raise QuantgateError(f"{where}: {key} missing or not an integer; cannot size the KV cache")
        heads, kv_heads, head_dim = attention_heads({"hidden_size": 0} | config)  # no hidden_size: head dim 0
        if not head_dim:
            raise QuantgateError(f"{where}: neither head_dim nor hidden_size; cannot size the KV cache")
        return cls(
            layers=config["num_hidden_layers"],
            kv_heads=kv_heads,
            head_dim=head_dim,
            query_heads=heads,
            max_context=config.get("max_position_embeddings"),
        )


def kv_dtype_bytes(kv_cache_dtype: str, serving_dtype: str) -> int:
    """Bytes per KV element for vLLM's --kv-cache-dtype (`auto` = the serving dtype's).
    Raises QuantgateError naming `kv_cache_dtype` for a value vLLM does not take."""
    name = serving_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    if name not in KV_DTYPE_BYTES:
        raise QuantgateError(
            f"kv_cache_dtype: {kv_cache_dtype!r} is not one of auto, {', '.join(sorted(KV_DTYPE_BYTES))}"
        )
    return KV_DTYPE_BYTES[name]


def kv_bytes_per_token(shape: KVShape, element_bytes: int, *, heads: str = "kv") -> int:
    """2 x layers x heads x head_dim x element_bytes; heads="query" gives the chapter's trap (too large)."""
    n = shape.kv_heads if heads == "kv" else shape.query_heads
    return 2 * shape.layers * n * shape.head_dim * element_bytes


def kv_capacity_tokens(kv_space_bytes: float, per_token: int) -> int:
    """Tokens of KV that fit in `kv_space_bytes` (vLLM then rounds down to whole blocks of 16)."""
    return int(kv_space_bytes // per_token)


def requests_per_device(device_bytes: float, weights_bytes: float, usable: float, per_request_bytes: float) -> int:
    """floor((device x usable - weights) / KV per request); 0 when the weights leave no room."""
    return max(0, math.floor((device_bytes * usable - weights_bytes) / per_request_bytes))


def in_flight(qps: float, ttft_s: float, output_tokens: int, tpot_s: float) -> float:
    """Little's law: requests in the system = arrival rate x residence (TTFT + tokens x TPOT)."""
    return qps * (ttft_s + output_tokens * tpot_s)


@dataclass(frozen=True)
class Devices:
    """Devices for a load: `memory` (KV bound), `batch` (running-batch cap bound), `needed` = the larger."""

    in_flight: float
    memory: int
    batch: int

    @property
    def needed(self) -> int:
        return max(self.memory, self.batch)

    @property
    def bound(self) -> str:
        return "memory" if self.memory >= self.batch else "batch cap"


def devices_for(in_flight_requests: float, per_device: int, batch_cap: int, utilization: float) -> Devices:
    """ceil(in flight / (capacity x utilization)) for the memory and the batch-cap capacities.
    `utilization` is the headroom: 0.8 plans each device at 80 % of what it could hold.
    Raises QuantgateError when no request fits on a device (per_device 0)."""
    if per_device <= 0:
        raise QuantgateError("no request fits on one device: the weights leave no room for its KV cache")
    return Devices(
        in_flight=in_flight_requests,
        memory=math.ceil(in_flight_requests / (per_device * utilization)),
        batch=math.ceil(in_flight_requests / (batch_cap * utilization)),
    )


def usd_per_million_tokens(device_hour_usd: float, output_tokens_per_s: float) -> float:
    """C_token x 1e6 = P_device-hour / (3600 x throughput) x 1e6 (the chapter's C_token formula).
    Raises QuantgateError for a throughput that is not positive."""
    if output_tokens_per_s <= 0:
        raise QuantgateError(f"throughput must be > 0 output tokens/s, got {output_tokens_per_s}")
    return device_hour_usd / (3600 * output_tokens_per_s) * 1e6


def mixed_seconds_per_token(baseline_s: float, quantized_s: float, quantized_fraction: float) -> float:
    """Estimated seconds per output token of a build with `quantized_fraction` (0..1, by weight count) of its
    targeted layers quantized and the rest 16-bit: baseline_s + (quantized_s - baseline_s) x fraction, from the
    two measured builds (the 16-bit one and the one with every targeted layer quantized, same load).

    Assumes each targeted weight costs the same time per token at its scheme wherever it sits, so a layer's
    share of the difference is its share of the weights. That holds where decoding streams the weights
    (memory-bound GPUs: time per token ~ bytes read) and where a scheme's kernel runs at one rate per weight
    (CPU); it ignores per-shape kernel efficiency, which only per-layer timings would catch. The profile of the
    mixed build itself is the check (the gate prints both). Raises QuantgateError for a fraction outside 0..1
    or a time that is not positive."""
    if not 0 <= quantized_fraction <= 1:
        raise QuantgateError(f"quantized fraction must be within 0..1, got {quantized_fraction}")
    if baseline_s <= 0 or quantized_s <= 0:
        raise QuantgateError(f"seconds per token must be > 0, got {baseline_s} and {quantized_s}")
    return baseline_s + (quantized_s - baseline_s) * quantized_fraction


def check_max_model_len(params: CostParams, max_model_len: int | None, where: str) -> None:
    """Raises QuantgateError (`where` starts it: "params.yaml:LINE: cost.context_tokens") when cost.context_tokens
    exceeds the server's max_model_len (evaluate.serve's, or what a profiled server ran with; unchecked when None
    or not positive, the length vLLM fits): the server would refuse the request the cost model prices."""
    if max_model_len is not None and max_model_len > 0 and params.context_tokens > max_model_len:
        raise QuantgateError(
            f"{where}: {params.context_tokens} tokens is longer than the server's max_model_len ({max_model_len}, "
            f"evaluate.serve.max_model_len); lower it or raise max_model_len"
        )


def check_context(params: CostParams, shape: KVShape, where: str = "params.yaml: cost.context_tokens") -> None:
    """Raises QuantgateError when cost.context_tokens exceeds the model's max_position_embeddings."""
    if shape.max_context is not None and params.context_tokens > shape.max_context:
        raise QuantgateError(
            f"{where}: {params.context_tokens} tokens is longer than the model's context "
            f"({shape.max_context}, max_position_embeddings); lower it"
        )
