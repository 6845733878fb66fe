"""GPU-ready defaults, tested without a GPU: the `auto` serving values per platform (the probe's answers
as data), the vLLM argv and environment they give, device selection and its one-line errors, and
scripts/gpu_check.sh failing clearly where there is no GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantgate import devices, serving
from quantgate.errors import QuantgateError
from quantgate.precision import attention_heads, kv_bytes_per_token, linear_shapes, resolve_eager, resolve_kv_cache_gib
from quantgate.serving import ServeParams, ServerStartError, command, resolved, runtime_record, vllm_server
from tests.test_serving import AVX2, AVX512_BF16, GPU, SMOLLM2

REPO = Path(__file__).resolve().parents[1]
# Llama-3.1-8B's attention shape (config.json): 32 layers, 8 KV heads of 128
LLAMA_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}


def model(tmp_path: Path, config: dict) -> Path:
    import json

    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_kv_bytes_per_token_known_answers():
    assert kv_bytes_per_token(SMOLLM2, "float32") == 30 * 3 * 64 * 2 * 4 == 46_080  # FINDINGS.md
    assert kv_bytes_per_token(SMOLLM2, "bfloat16") == 23_040
    assert kv_bytes_per_token(LLAMA_8B, "bfloat16") == 131_072  # 2*32*8*128*2: 0.54 GB per 4,096 tokens
    with pytest.raises(QuantgateError, match="c.json has no num_hidden_layers: cannot size the KV cache; set evaluate"):
        kv_bytes_per_token({"num_attention_heads": 9, "hidden_size": 576}, "float32", "c.json")


def test_attention_heads_are_read_once_for_the_kv_cache_the_cost_model_and_the_linears():
    """num_key_value_heads and head_dim were read from config.json in three places (precision's KV size and
    linear shapes, cost's KVShape); one function reads them for all three."""
    from quantgate.cost import KVShape

    assert attention_heads(SMOLLM2) == (9, 3, 64)  # GQA; head dim 576 / 9
    assert attention_heads(LLAMA_8B) == (32, 8, 128)
    assert attention_heads({"num_attention_heads": 8, "num_key_value_heads": None, "head_dim": 256}) == (8, 8, 256)
    with pytest.raises(KeyError, match="hidden_size"):
        attention_heads({"num_attention_heads": 8})
    shape = KVShape.from_config(LLAMA_8B)
    assert (shape.query_heads, shape.kv_heads, shape.head_dim) == (32, 8, 128)
    llama = LLAMA_8B | {"intermediate_size": 14336}
    assert linear_shapes(llama)[:2] == [((32 + 2 * 8) * 128, 4096), (4096, 32 * 128)]
    assert linear_shapes(llama | {"head_dim": 64})[1] == (4096, 32 * 64)  # a given head_dim wins over hidden / heads
    with pytest.raises(QuantgateError, match="c.json: neither head_dim nor hidden_size; cannot size the KV cache"):
        KVShape.from_config({"num_hidden_layers": 2, "num_attention_heads": 8}, "c.json")


@pytest.mark.parametrize(
    "platform, config, dtype, gib, eager",
    [
        (AVX2, SMOLLM2, "float32", 2, True),  # 46,080 B x 2048 x 16 = 1.41 GiB -> 2 (today's hard-coded 2)
        (AVX512_BF16, SMOLLM2, "bfloat16", 1, True),  # 0.70 GiB -> 1
        (AVX512_BF16, LLAMA_8B, "bfloat16", 4, True),  # 131,072 x 2048 x 16 = 4 GiB exactly
        (GPU, LLAMA_8B, "bfloat16", None, False),  # vLLM's own (--gpu-memory-utilization), CUDA graphs
    ],
)
def test_auto_serving_values_per_platform(tmp_path, platform, config, dtype, gib, eager):
    assert resolve_kv_cache_gib("auto", platform, model(tmp_path, config), dtype, 2048)[0] == gib
    assert resolve_eager("auto", platform)[0] is eager
    assert resolve_kv_cache_gib(6, platform, tmp_path / "absent", dtype, 2048) == (
        6,
        "set in evaluate.serve.kv_cache_gib",
    )
    assert resolve_eager(False, platform) == (False, "set in evaluate.serve.enforce_eager")


def test_auto_kv_cache_for_max_model_len_minus_one_takes_the_models_context(tmp_path):
    """-1 gave "16 sequences x -1 tokens", a 1 GiB floor; vLLM fits the length up to the model's context."""
    config = SMOLLM2 | {"max_position_embeddings": 8192}
    gib, why = resolve_kv_cache_gib("auto", AVX2, model(tmp_path, config), "float32", -1)
    assert gib == 6  # 46,080 B x 8192 x 16 = 5.63 GiB, rounded up
    assert why == "auto: CPU: 16 sequences x 8192 tokens (max_model_len -1: the model's context) x 46080 B/token"
    with pytest.raises(QuantgateError, match=r"m/config.json has no max_position_embeddings: .*set it to a number"):
        resolve_kv_cache_gib("auto", AVX2, model(tmp_path, SMOLLM2), "float32", -1)


@pytest.mark.parametrize("platform", [AVX2, GPU])
def test_resolved_params_become_the_vllm_argv_and_env(tmp_path, monkeypatch, platform):
    monkeypatch.setattr(serving, "probe", lambda python: platform)
    monkeypatch.setattr(devices, "gpu_count", lambda: 0 if platform.is_cpu else 1)
    started = {}

    def popen(argv, env, **k):
        started.update(argv=argv, env=env)
        raise OSError("stop here")

    monkeypatch.setattr(serving.subprocess, "Popen", popen)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    with pytest.raises(OSError, match="stop here"):
        with vllm_server(ServeParams(python=sys.executable), model(tmp_path, SMOLLM2), "fp16", tmp_path / "log"):
            pass
    argv, env = started["argv"], started["env"]
    if platform.is_cpu:
        assert "--enforce-eager" in argv and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
        assert "--kv-cache-memory-bytes" not in argv
    else:  # CUDA graphs; vLLM sizes the KV cache; an explicit size is a flag, not the CPU variable
        assert "--enforce-eager" not in argv and "VLLM_CPU_KVCACHE_SPACE" not in env
        explicit = resolved(ServeParams(python="py", kv_cache_gib=3, enforce_eager=True))
        argv = command(explicit, tmp_path, "m", 1, gpu=True)
        assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(3 * 2**30) and "--enforce-eager" in argv
    assert "CUDA_VISIBLE_DEVICES" not in env  # devices: auto leaves it as it is


def test_runtime_record_says_what_auto_chose_and_why(tmp_path, monkeypatch):
    monkeypatch.setattr(serving, "probe", lambda python: AVX2)
    got = runtime_record(ServeParams(python="py"), model(tmp_path, SMOLLM2))
    assert got == {
        "enforce_eager": {"value": True, "why": "auto: CPU (skips the torch.compile warm-up)"},
        "kv_cache_gib": {"value": 2, "why": "auto: CPU: 16 sequences x 2048 tokens x 46080 B/token"},
        "devices": {"value": "auto", "cuda_visible_devices": None},
    }


def test_params_yaml_defaults_are_auto():
    from pipeline.evaluate import EvaluateParams
    from quantgate.params import load_block

    serve = load_block("evaluate", EvaluateParams, REPO / "params.yaml").serve
    assert (serve.dtype, serve.kv_cache_gib, serve.enforce_eager, serve.devices) == ("auto",) * 4
    assert "--enforce-eager" not in serve.extra_args


def test_devices_values_and_errors(tmp_path, monkeypatch):
    assert devices.visible_devices("auto", "evaluate.serve.devices", count=0) is None
    assert devices.visible_devices("cpu", "evaluate.serve.devices", count=2) == ""
    assert devices.visible_devices("0,1", "evaluate.serve.devices", count=2) == "0,1"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("evaluate:\n  serve:\n    devices: '1'\n")
    with pytest.raises(QuantgateError) as err:
        devices.visible_devices("1", "evaluate.serve.devices", count=0)
    assert str(err.value) == (
        "params.yaml:3: evaluate.serve.devices: GPU 1 requested, but this machine has no GPU "
        "(nvidia-smi lists none); set it to auto or cpu"
    )
    with pytest.raises(QuantgateError, match=r"GPU 2 requested, but this machine has 2 GPU\(s\), numbered from 0"):
        devices.visible_devices("0,2", "quantize.int4.devices", count=2)
    for bad in ("gpu", "0, 1", "cuda:0", ""):
        with pytest.raises(ValueError, match="is not auto, cpu, or GPU indices"):
            ServeParams(devices=bad)


def test_a_gpu_requested_without_one_stops_before_any_server(tmp_path, monkeypatch):
    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    monkeypatch.setattr(serving, "probe", lambda python: pytest.fail("probed"))
    monkeypatch.setattr(serving.subprocess, "Popen", lambda *a, **k: pytest.fail("a server was started"))
    with pytest.raises(QuantgateError, match="evaluate.serve.devices: GPU 0 requested, but this machine has no GPU"):
        with vllm_server(ServeParams(python=sys.executable, devices="0"), tmp_path, "fp16", tmp_path / "log"):
            pass
    assert not issubclass(QuantgateError, ServerStartError)  # a config error stops the stage, not one build


def test_quantize_stage_refuses_a_missing_gpu_in_one_line(tmp_path):
    import shutil

    for f in ("params.yaml", "recipes/fp8.yaml"):
        (tmp_path / f).parent.mkdir(exist_ok=True)
        shutil.copy(REPO / f, tmp_path / f)
    text = (tmp_path / "params.yaml").read_text()
    (tmp_path / "params.yaml").write_text(
        text.replace("recipe: recipes/fp8.yaml", "recipe: recipes/fp8.yaml\n    devices: '0'", 1)  # the fp8 block's
    )
    env = dict(os.environ, PATH="/usr/bin:/bin", PYTHONPATH=str(REPO))  # no nvidia-smi
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.quantize", "fp8", "models/fp16", "models/fp8"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    line = next(i + 1 for i, s in enumerate(text.splitlines()) if "recipe: recipes/fp8.yaml" in s) + 1
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"quantgate: error: params.yaml:{line}: quantize.fp8.devices: GPU 0 requested, but this machine has no GPU "
        "(nvidia-smi lists none); set it to auto or cpu"
    )


def test_gpu_count_reads_nvidia_smi(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-1)'\necho 'GPU 1: NVIDIA H200 (UUID: GPU-2)'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert devices.gpu_count() == 2
    fake.write_text(
        "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the driver'\nexit 9\n"
    )
    assert devices.gpu_count() == 0
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert devices.gpu_count() == 0


def gpu_check(tmp_path, path: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=path, PYTHON=sys.executable)
    return subprocess.run(
        [str(REPO / "scripts/gpu_check.sh"), str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_gpu_check_fails_clearly_without_a_gpu(tmp_path):
    out = gpu_check(tmp_path, "/usr/bin:/bin")  # no nvidia-smi
    assert (out.returncode, out.stderr) == (
        2,
        "gpu_check: no GPU here (no nvidia-smi on PATH); run it on a machine with an NVIDIA GPU\n",
    )
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    fake.chmod(0o755)
    out = gpu_check(tmp_path, f"{tmp_path}:/usr/bin:/bin")
    assert out.returncode == 2
    assert (
        out.stderr
        == "gpu_check: no GPU here (nvidia-smi -L: No devices were found); run it on a machine with an NVIDIA GPU\n"
    )
    # a driver that lists a GPU, but a CPU-only torch: the Python side says so, in one line
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-1)'\n")
    out = gpu_check(tmp_path, f"{tmp_path}:/usr/bin:/bin")
    assert out.returncode == 2 and not (tmp_path / "out").exists()
    assert out.stderr.strip().splitlines() == [
        "gpu_check: torch 2.13.0+cpu sees no GPU (CUDA build: None); run it on a GPU machine"
    ]


def test_gpu_check_refuses_bad_arguments_in_one_line_with_exit_2(tmp_path):
    # OUT_DIR a file and QUANTGATE_GPU_CHECK_SAMPLES not a number were tracebacks with exit 1 ("a check failed"),
    # and --help was taken for OUT_DIR (the script behind it would have made a folder named --help)
    (tmp_path / "a-file").write_text("")
    script = str(REPO / "scripts/gpu_check.py")
    cpu = dict(os.environ, QUANTGATE_GPU_CHECK_DEVICE="cpu")
    for argv, env, said in (
        ([script, str(tmp_path / "a-file")], cpu, f"OUT_DIR {tmp_path / 'a-file'}: not a folder; give a folder path"),
        ([script, str(tmp_path / "o")], dict(cpu, QUANTGATE_GPU_CHECK_SAMPLES="abc"), "SAMPLES='abc': give a whole"),
        ([script, str(tmp_path / "o")], dict(cpu, QUANTGATE_GPU_CHECK_SAMPLES="0"), "SAMPLES='0': give a whole"),
    ):
        out = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and said in out.stderr, out.stderr
    out = subprocess.run([str(REPO / "scripts/gpu_check.sh"), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "scripts/gpu_check.sh [OUT_DIR [MODEL_DIR]]" in out.stdout and not out.stderr
    # timeout(1) reads 0 as no limit at all, 8m as 8 minutes; 20 digits failed bash's [ -lt ] and ran with no limit
    for limit in ("0", "8m", "-5", "99999999999999999999"):
        out = subprocess.run(
            [str(REPO / "scripts/gpu_check.sh"), str(tmp_path / "o")],
            env=dict(cpu, GPU_CHECK_TIMEOUT_S=limit, PYTHON="/bin/false"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (out.returncode, out.stderr) == (
            2,
            f"gpu_check: GPU_CHECK_TIMEOUT_S='{limit}': give whole seconds, 1 to 999999999 (default 480)\n",
        )
    assert not (REPO / "--help").exists() and not (tmp_path / "o").exists()
