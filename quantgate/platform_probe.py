"""What the serving env's vLLM runs on, asked by running it: `SERVE_PYTHON quantgate/platform_probe.py`
(the platform), or `... platform_probe.py speed JSON` (how much slower a scheme's linears run here, `speed`).

Run by quantgate.precision.probe in the serving env (.venv-serve), which does not have quantgate installed,
so this file imports only the standard library at module level (torch and vLLM inside `main`) and the
pipeline env's unit tests can import its helpers. It prints one JSON line on stdout and, on stderr, a
`probe: <stage>` line before each stage, so a probe that dies says where.

Each kernel call runs in a child of its own (`isolated`, os.fork after the vLLM import, so no child pays
for a fresh import): a call that crashes (SIGILL, SIGSEGV, any signal) or hangs is recorded as that call's
answer, e.g. "died with SIGILL", and the probe goes on. Before an AMX call the child asks the kernel for
AMX tile state (`request_amx`): Linux kills a process that uses AMX tile registers without
arch_prctl(ARCH_REQ_XCOMP_PERM), which vLLM's CPU workers request through `torch._C._cpu._init_amx()`
(vllm/v1/worker/cpu_worker.py, 0.32).
"""

from __future__ import annotations

import faulthandler
import json
import os
import resource
import signal
import sys
import time

CALL_TIMEOUT_S = 30.0  # one tiny GEMM takes milliseconds; this bounds a call that hangs (7 calls < the probe's 300 s)
DTYPES = ("float32", "bfloat16", "float16")


def stage(what: str) -> None:
    """Say on stderr what the probe does next (quantgate.precision quotes the last one if the probe dies)."""
    print(f"probe: {what}", file=sys.stderr, flush=True)


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, at most 300 characters of message."""
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0][:300] if msg else ''}"


def isolated(call, timeout_s: float = CALL_TIMEOUT_S) -> str:
    """Run `call()` (returns a str) in a forked child and return its answer.

    A raised exception is the answer "Type: message"; a child killed by a signal answers
    "died with SIGNAME", one that exits without answering "exited with code N without an answer", one
    still running after `timeout_s` seconds is killed and answers "no answer in N s". Never raises for
    what the child does. POSIX only (os.fork)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer through the pipe, then leave without running the parent's cleanup
        os.close(read_fd)
        faulthandler.disable()  # a crash is the answer here, not a traceback on the probe's stderr
        try:  # nor a core file (hundreds of MB) in the project folder where core dumps are on
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        except (ValueError, OSError):
            pass
        try:
            answer = str(call())
        except BaseException as exc:
            answer = one_line(exc)
        os.write(write_fd, answer.encode()[:4000])  # under the pipe's buffer: the write cannot block
        os._exit(0)
    os.close(write_fd)
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_fd)
            return f"no answer in {timeout_s:g} s"
        time.sleep(0.01)
    chunks = []
    while chunk := os.read(read_fd, 4096):
        chunks.append(chunk)
    os.close(read_fd)
    if os.WIFSIGNALED(status):
        return f"died with {signal.Signals(os.WTERMSIG(status)).name}"
    if os.WEXITSTATUS(status) != 0 or not chunks:
        return f"exited with code {os.WEXITSTATUS(status)} without an answer"
    return b"".join(chunks).decode(errors="replace")


def request_amx(torch) -> bool:
    """Ask the kernel for AMX tile state for this process, as vLLM's CPU workers do; True if granted.
    False where torch has no such call or the kernel refuses (the AMX call may then die with SIGILL)."""
    init = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    try:
        return bool(init()) if init else False
    except Exception:
        return False


def w4a16_call(torch, gemm, dtype_name: str, amx: bool) -> str:
    """One tiny W4A16 GEMM through vLLM's CPUWNA16LinearKernel op `gemm` (vllm._custom_ops.cpu_gemm_wna16):
    K = N = 32 (the kernel's multiple), one group of 32, weights packed as
    CPUWNA16LinearKernel._process_gptq_weights_w4a16 leaves them ([N / 16, K * 16 / 8] int32), scales
    [groups, N]; isa hint "amx" for bfloat16 on AMX CPUs, as vLLM's _get_isa_hint. "ok" or what is wrong."""
    dt = getattr(torch, dtype_name)
    isa = "amx" if amx and dtype_name == "bfloat16" else "vec"
    if isa == "amx":
        request_amx(torch)
    y = gemm(
        torch.ones(1, 32, dtype=dt),
        torch.zeros(2, 64, dtype=torch.int32),
        torch.ones(1, 32, dtype=dt),
        None,
        None,
        8,
        isa,
    )
    return "ok" if tuple(y.shape) == (1, 32) and bool(torch.isfinite(y).all()) else f"bad output {tuple(y.shape)}"


def w4a16_calls(torch, gemm, amx: bool, timeout_s: float = CALL_TIMEOUT_S) -> dict[str, str]:
    """{activation dtype: "ok" | "missing" | the error or death of its call}, each call isolated; `gemm`
    None = the op is missing from the kernel library vLLM loaded."""
    calls = {}
    for name in DTYPES:
        if gemm is None:
            calls[name] = "missing"
            continue
        stage(f"W4A16 call at {name}")
        calls[name] = isolated(lambda name=name: w4a16_call(torch, gemm, name, amx), timeout_s)
    return calls


def w4a8_call(torch, ops) -> str:
    """One tiny W4A8 GEMM through the ops vLLM's CPUWNA16LinearKernel runs with VLLM_CPU_INT4_W4A8=1 on AMX
    (vllm._custom_ops: convert_weight_packed_scale_zp, then int4_scaled_mm_cpu at bfloat16): K = N = 32, one
    group, weights all 0 with zero point 8 in AWQ's packing ([K, N / 8] int32, as _process_gptq_weights_w4a8
    repacks them), scales 1, so every output is (0 - 8) x 32 = -256. "ok" or what is wrong."""
    request_amx(torch)
    zero_point_8 = -2004318072  # 0x88888888 as int32: 8 in every nibble
    w, zp, s = ops.convert_weight_packed_scale_zp(
        torch.zeros(32, 4, dtype=torch.int32),
        torch.full((1, 4), zero_point_8, dtype=torch.int32),
        torch.ones(1, 32, dtype=torch.bfloat16),
        ops.CPUQuantAlgo.AWQ,
    )
    y = ops.int4_scaled_mm_cpu(torch.ones(1, 32, dtype=torch.bfloat16), w, zp, s, None)
    if tuple(y.shape) != (1, 32):
        return f"bad output shape {tuple(y.shape)}"
    return "ok" if bool((y.float() == -256.0).all()) else f"wrong output {y.float()[0, :4].tolist()} (expected -256)"


def w4a8_answer(torch, amx: bool, timeout_s: float = CALL_TIMEOUT_S) -> str:
    """The W4A8 call's answer (isolated) on an AMX CPU, where vLLM would run it; "no AMX" elsewhere (vLLM
    serves W4A16 there whatever VLLM_CPU_INT4_W4A8 says); "missing" when the kernel library lacks the ops."""
    if not amx:
        return "no AMX"
    if not (hasattr(torch.ops._C, "int4_scaled_mm_cpu") and hasattr(torch.ops._C, "convert_weight_packed_scale_zp")):
        return "missing"
    from vllm import _custom_ops as ops

    stage("W4A8 call at bfloat16")
    return isolated(lambda: w4a8_call(torch, ops), timeout_s)


W8A8_ROWS = (1, 64)  # activation rows of the int8 call: a decoding step, a prefill chunk
W8A8_SGL = "int8_scaled_mm_with_quant (AMX)"  # vLLM CPU's two int8 W8A8 kernels, as the probe names them
W8A8_ONEDNN = "onednn_scaled_mm (oneDNN)"


def w8a8_kernel(torch, amx: bool) -> str:
    """The kernel vLLM's CPUInt8ScaledMMLinearKernel picks for an int8 W8A8 linear with symmetric activations
    (llm-compressor's W8A8 at int) whose K is a multiple of 32 and N of 16, as every linear of the default
    model's is: the AMX one where `check_cpu_sgl_kernel` says so (AMX tiles), oneDNN elsewhere
    (vllm/model_executor/kernels/linear/scaled_mm/cpu.py, 0.32)."""
    try:
        from vllm.model_executor.layers.utils import check_cpu_sgl_kernel

        sgl = bool(check_cpu_sgl_kernel(32, 32, torch.int8))
    except Exception:  # an older or newer vLLM without the helper: AMX tiles decide, as in 0.32
        sgl = amx
    return W8A8_SGL if sgl else W8A8_ONEDNN


def w8a8_call(torch, ops, dtype_name: str, kernel: str) -> str:
    """One tiny int8 W8A8 GEMM through `kernel` (w8a8_kernel), step for step as CPUInt8ScaledMMLinearKernel
    runs it for dynamic per-token symmetric activations: N = K = 32, weights [N, K] all 127 (int8's largest)
    with per-channel scales 1/127, activations [1, K] all 1 at `dtype_name` (quantized to 127 with scale
    1/127), so every output is 32. "ok" or what is wrong.

    The largest values on both sides are what a kernel that sums int8 products in 16 bits gets wrong: oneDNN's
    int8 GEMM below AVX512_VNNI, as vLLM 0.32 calls it (u8 activations shifted by 128, VPMADDUBSW pair sums
    saturating at 32767), answers about 0.8 % of the exact value for K = 576 and 15 % off on random data
    (measured on a 2-core AMD EPYC held to AVX2 or AVX512_CORE by ONEDNN_MAX_CPU_ISA, 2026-12-07; exact with
    AVX512_CORE_VNNI). Weights of 1, as before, never reach the limit. The call is made for one row (a decoding
    step) and for 64 (a prefill chunk), since a library may pick another kernel for each."""
    dt = getattr(torch, dtype_name)
    w = torch.full((32, 32), 127, dtype=torch.int8)
    w_scale = torch.full((32, 1), 1 / 127, dtype=torch.float32)
    if kernel == W8A8_SGL:
        request_amx(torch)
        packed = torch.ops._C.convert_weight_packed(w)
    else:
        w_kn = w.t()  # process_weights_for_onednn keeps [K, N]
        azp_adj = w_kn.sum(dim=0, keepdim=True, dtype=torch.float32) * w_scale.squeeze()
        handler = ops.create_onednn_scaled_mm(w_kn, w_scale, dt, True, False, 32)
    for rows in W8A8_ROWS:
        x = torch.ones(rows, 32, dtype=dt)
        if kernel == W8A8_SGL:
            y = torch.ops._C.int8_scaled_mm_with_quant(x, packed, w_scale, None, dt, True)
        else:
            x_q, x_s, x_zp = ops.onednn_scaled_int8_quant(x, None, None, True)
            y = torch.empty((rows, handler.n), dtype=dt)
            ops.onednn_scaled_mm(handler, x_q, y, x_s, x_zp, azp_adj, None)
        if tuple(y.shape) != (rows, 32):
            return f"bad output shape {tuple(y.shape)}"
        if not bool((y.float() - 32.0).abs().max() < 0.5):
            at = "" if rows == 1 else f", at {rows} rows"
            return f"wrong output {y.float()[0, :4].tolist()} (expected 32{at})"
    return "ok"


def w8a8_calls(torch, amx: bool, timeout_s: float = CALL_TIMEOUT_S) -> tuple[str, dict[str, str]]:
    """(kernel, {activation dtype: "ok" | "missing" | the error or death of its call}) for vLLM CPU's int8
    W8A8 kernel here, each call isolated. Measured on a 2-core Sapphire Rapids Xeon (AMX, no AMX-FP16),
    2026-12-06: the AMX kernel answers ok at bfloat16, raises "expect A to be bfloat16 or half" at float32
    and aborts the process at float16 ("tinygemm_kernel_nn: scalar path not implemented!")."""
    kernel = w8a8_kernel(torch, amx)
    needs = (
        ("int8_scaled_mm_with_quant", "convert_weight_packed")
        if kernel == W8A8_SGL
        else ("create_onednn_scaled_mm_handler", "onednn_scaled_mm", "dynamic_scaled_int8_quant")
    )
    if not all(hasattr(torch.ops._C, op) for op in needs):
        return kernel, dict.fromkeys(DTYPES, "missing")
    from vllm import _custom_ops as ops

    calls = {}
    for name in DTYPES:
        stage(f"int8 W8A8 call at {name}")
        calls[name] = isolated(lambda name=name: w8a8_call(torch, ops, name, kernel), timeout_s)
    return kernel, calls


def version(*names: str) -> str | None:
    """The installed version of the first of `names` that is installed, else None."""
    import importlib.metadata as m

    for n in names:
        try:
            return m.version(n)
        except m.PackageNotFoundError:
            pass
    return None


FP8_MAX = 448.0  # largest float8_e4m3fn value: per-token dynamic scales map each row's amax onto it
SPEED_REPS = 3  # timed repetitions (the median is kept), after one warm-up


def torch_fp8_path(torch):
    """(quant, scaled_mm) written out in torch, step for step as vllm-cpu 0.32 runs FP8_DYNAMIC on a CPU
    without AMX-FP8 (QuantFP8's native per-token path padded to 17 rows, then
    ChannelWiseTorchFP8ScaledMMLinearKernel.apply_scaled_mm): used where vLLM's own classes do not import."""

    def quant(x):
        scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
        xq = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX)
        if x.shape[0] < 17:
            xq = torch.nn.functional.pad(xq, (0, 0, 0, 17 - x.shape[0]))
        return xq.to(torch.float8_e4m3fn), scale

    def scaled_mm(A, B, out_dtype, As, Bs, bias, output_shape):
        one = torch.ones(1, dtype=torch.float32)
        out = torch._scaled_mm(A, B, scale_a=one, scale_b=one, out_dtype=torch.float32)[: output_shape[0]]
        return (out * As * Bs.t()).to(out_dtype)

    return quant, scaled_mm


def vllm_fp8_path(torch):
    """(quant, scaled_mm, what) from vLLM itself: QuantFP8 (dynamic, per token, padded to 17 rows as without
    torch.compile) and ChannelWiseTorchFP8ScaledMMLinearKernel.apply_scaled_mm, the kernel vllm-cpu 0.32
    selects for FP8_DYNAMIC on a CPU without AMX-FP8; the torch steps (torch_fp8_path) if they do not import."""
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.kernels.linear.scaled_mm.pytorch import ChannelWiseTorchFP8ScaledMMLinearKernel
        from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
        from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

        with set_current_vllm_config(VllmConfig()):
            quant = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN, num_token_padding=17)
    except Exception:
        quant, scaled_mm = torch_fp8_path(torch)
        return quant, scaled_mm, "torch steps of vLLM's FP8 path (vLLM's classes did not import)"

    def scaled_mm(**kw):
        return ChannelWiseTorchFP8ScaledMMLinearKernel.apply_scaled_mm(None, **kw)

    return quant, scaled_mm, "vLLM QuantFP8 + ChannelWiseTorchFP8ScaledMMLinearKernel.apply_scaled_mm"


TIMED_LAYERS = 2  # decoder layers built and timed; the whole forward is extrapolated (speed)


def fp8_module(torch, linear, path):
    """A stand-in for `linear` (torch.nn.Linear) that runs FP8_DYNAMIC through `path` = (quant, scaled_mm):
    its weight quantized to float8_e4m3fn per output channel, activations per token at run time."""
    quant, scaled_mm = path
    w = linear.weight.detach()
    w_scale = w.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    w8 = (w.float() / w_scale).to(torch.float8_e4m3fn).t()  # [in, out], column-major as vLLM keeps it

    class FP8Linear(torch.nn.Module):
        def forward(self, x):
            x2 = x.reshape(-1, x.shape[-1])
            xq, x_scale = quant(x2)
            out = scaled_mm(
                A=xq,
                B=w8,
                out_dtype=x.dtype,
                As=x_scale,
                Bs=w_scale,
                bias=None,
                output_shape=[x2.shape[0], w8.shape[1]],
            )
            return out.reshape(*x.shape[:-1], w8.shape[1])

    return FP8Linear()


def median_ms(torch, f) -> float:
    """Median ms of `f()` over SPEED_REPS calls after one warm-up, without autograd."""
    times = []
    with torch.no_grad():
        f()
        for _ in range(SPEED_REPS):
            began = time.perf_counter()
            f()
            times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2] * 1e3


def speed(request: dict, stop_above: float | None = None) -> dict:
    """How many times slower a whole forward runs here with FP8_DYNAMIC linears (vLLM's own FP8 path,
    vllm_fp8_path) than with 16-bit ones, for a request {"scheme": "FP8_DYNAMIC", "dtype", "config" (the
    build's config.json), "tokens": [rows, ...]}. Token counts are timed in the request's order; once one
    ratio is over `stop_above` the rest are not timed and listed in "untimed" (one ratio over the bound
    decides, and emulated FP8 can be thousands of times slower: a 256-token prompt took 46 s for two layers on
    a 2-core AMX Xeon, 2026-12-05).

    The build's architecture is built in transformers with TIMED_LAYERS decoder layers and random weights
    (timing does not depend on their values); per-layer ms (the decoder body's forward / TIMED_LAYERS) and
    lm_head ms (16-bit in both: the recipe keeps it) give the whole forward of L layers as L x layer + head.
    Returns {"ratio" (the largest), "per_tokens": {rows: ratio}, "ms_16bit"/"ms_scheme": {rows: whole-forward
    ms}, "kernel"}. Raises ValueError for a scheme without a timed path."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if request["scheme"] != "FP8_DYNAMIC":
        raise ValueError(f"no timed path for scheme {request['scheme']!r}")
    stage("loading vLLM's FP8 path")
    quant, scaled_mm, kernel = vllm_fp8_path(torch)
    stage("building the model's layers from its config")
    config = AutoConfig.for_model(**{k: v for k, v in request["config"].items() if k != "quantization_config"})
    layers = config.num_hidden_layers
    config.num_hidden_layers = min(layers, TIMED_LAYERS)
    dtype = getattr(torch, request["dtype"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    body, head = model.get_decoder(), model.get_output_embeddings()

    def timed(tokens: int) -> float:
        ids = torch.zeros(1, tokens, dtype=torch.long)
        hidden = torch.randn(1, tokens, config.hidden_size, dtype=dtype)
        layer = median_ms(torch, lambda: body(input_ids=ids, use_cache=False)) / config.num_hidden_layers
        return layers * layer + median_ms(torch, lambda: head(hidden))

    base = {}
    for tokens in request["tokens"]:
        stage(f"timing 16-bit layers at {request['dtype']} on {tokens} tokens")
        base[str(tokens)] = timed(tokens)
    for module in list(body.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, fp8_module(torch, child, (quant, scaled_mm)))
    slow, per_tokens = {}, {}
    for tokens in request["tokens"]:
        if stop_above is not None and per_tokens and max(per_tokens.values()) > stop_above:
            break
        stage(f"timing FP8_DYNAMIC layers at {request['dtype']} on {tokens} tokens")
        slow[str(tokens)] = timed(tokens)
        per_tokens[str(tokens)] = round(slow[str(tokens)] / base[str(tokens)], 2)
    untimed = [t for t in base if t not in slow]
    return {
        "ratio": max(per_tokens.values()),
        "per_tokens": per_tokens,
        "ms_16bit": {t: round(v, 2) for t, v in base.items()},
        "ms_scheme": {t: round(v, 2) for t, v in slow.items()},
        "kernel": kernel,
        **({"untimed": untimed} if untimed else {}),
    }


def main() -> None:
    if len(sys.argv) in (3, 4) and sys.argv[1] == "speed":
        stop_above = float(sys.argv[3]) if len(sys.argv) == 4 else None
        print(json.dumps(speed(json.loads(sys.argv[2]), stop_above)), flush=True)
        return
    stage("importing torch and vLLM")
    import torch
    from vllm.platforms import current_platform as p

    out = {
        "device": "cpu" if p.is_cpu() else str(p.device_name),
        "versions": {
            "vllm": version("vllm", "vllm-cpu"),
            "torch": version("torch"),
            "transformers": version("transformers"),
            "compressed-tensors": version("compressed-tensors"),
        },
    }
    if p.is_cpu():
        stage("loading vLLM's CPU kernel library")
        p.import_kernels()
        c = torch.cpu
        avx512, bf16, amx = c._is_avx512_supported(), c._is_avx512_bf16_supported(), c._is_amx_tile_supported()
        out["isa"] = {"avx512": bool(avx512), "avx512_bf16": bool(bf16), "amx": bool(amx)}
        out["native_bf16"] = bool(bf16 or amx)
        out["kernel_library"] = ("_C" if bf16 else "_C_AVX512") if avx512 else "_C_AVX2"
        gemm = None
        if hasattr(torch.ops._C, "cpu_gemm_wna16"):
            from vllm import _custom_ops as ops

            gemm = ops.cpu_gemm_wna16
        out["w4a16"] = w4a16_calls(torch, gemm, bool(amx))
        out["w4a8"] = w4a8_answer(torch, bool(amx))
        out["w8a8_kernel"], out["w8a8"] = w8a8_calls(torch, bool(amx))
    stage("done")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
