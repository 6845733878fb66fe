"""A vLLM server that dies after it was ready is reported as a death: quantgate.serving.Server.death
(build, seconds, exit code or signal, the log's last error line since ready, the log path), and the
evaluate, profile and calibrate stages and the canary fleets give that reason instead of the
refused connections that follow. The server here is a real process, tests/fake_vllm_server.py,
started by the real vllm_server and killed with a real signal; the real vLLM version of this test is
tests/test_e2e.py's project in tests/test_death_e2e.py."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil
import pytest
import requests

import pipeline.evaluate as evaluate_stage
import pipeline.team_scores as team_scores
from pipeline.evaluate import EvaluateParams, evaluate
from quantgate import serving
from quantgate.errors import QuantgateError
from quantgate.results import ServingRecord, TeamScores
from quantgate.serving import ServeParams, Server, ServerDied, exit_words, free_port, log_reason, vllm_server
from tests.conftest import safetensors_build, write_scores

REPO = Path(__file__).resolve().parents[1]
FAKE = REPO / "tests" / "fake_vllm_server.py"
ENGINE_ERROR = "TimeoutError: RPC call to execute_model timed out."


@pytest.fixture
def fake_vllm(monkeypatch):
    """vllm_server(...) as a context manager factory that starts tests/fake_vllm_server.py in MODE instead of vLLM
    (no probe, no serving env): fake_vllm(MODE, NAME, LOG_PATH)."""
    monkeypatch.setattr(serving, "HEALTH_POLL_S", 0.05)
    monkeypatch.setattr(serving, "resolved", lambda params, model_dir=None: params)
    monkeypatch.setattr(serving, "check_servable", lambda *a, **k: None)
    monkeypatch.setattr(serving, "probe", lambda python: SimpleNamespace(is_cpu=True))
    mode = {}
    monkeypatch.setattr(
        serving,
        "command",
        lambda params, model_dir, name, port, gpu=False: [sys.executable, str(FAKE), str(port), mode["m"], params.host],
    )

    def start(m: str, name: str, log_path: Path, host: str = "127.0.0.1"):
        mode["m"] = m
        return vllm_server(ServeParams(python=sys.executable, host=host), log_path.parent, name, log_path)

    return start


def engine_error(server: Server) -> threading.Thread:
    """Send `server` a request that makes the fake engine log its error; return once it is in the log."""

    def post():
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{server.base_url}/completions", json={"prompt": "2+2="}, timeout=30)

    t = threading.Thread(target=post, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while ENGINE_ERROR not in server.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    return t


def test_a_server_killed_after_ready_is_a_death_naming_build_seconds_signal_and_last_error_line(fake_vllm, tmp_path):
    log = tmp_path / "fp8" / "server.log"
    with fake_vllm("hang", "fp8", log) as server:
        assert server.death() is None and not server.exited()
        engine_error(server)
        time.sleep(max(0.0, server.watch.ready_at + 2.0 - time.monotonic()))
        os.killpg(server.pid, signal.SIGKILL)
        reason = server.death(wait_s=5)
        assert server.exited()
        # the triton error line was logged before it was ready: not the reason; vLLM's log prefix is dropped
        assert reason == (f"vLLM server for fp8 died with SIGKILL, 2 s after it was ready: {ENGINE_ERROR} (log: {log})")
        assert server.death() == reason  # asked again: the same line


def test_a_server_that_exits_by_itself_names_its_exit_code(fake_vllm, tmp_path):
    log = tmp_path / "int8" / "server.log"
    with fake_vllm("exit", "int8", log) as server:
        engine_error(server)
        reason = server.death(wait_s=5)
    assert re.fullmatch(
        rf"vLLM server for int8 exited with code 1, \d+ s after it was ready: {ENGINE_ERROR} \(log: .*\)", reason
    )


def test_a_death_without_an_error_line_since_ready_says_so(fake_vllm, tmp_path):
    with fake_vllm("hang", "fp16", tmp_path / "fp16" / "server.log") as server:
        os.killpg(server.pid, signal.SIGKILL)
        assert server.death(wait_s=5).endswith(
            f"died with SIGKILL, 0 s after it was ready: no error line in its log (log: {server.log_path})"
        )


def test_a_server_on_an_ipv6_host_gets_a_port_there_and_a_bracketed_url(fake_vllm, tmp_path):
    """evaluate.serve.host ::1 found its free port on IPv4 and wrote http://::1:PORT/v1, which no client reads."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    assert free_port("::1") > 0
    with fake_vllm("hang", "fp16", tmp_path / "fp16" / "server.log", host="::1") as server:
        assert server.base_url.startswith("http://[::1]:") and server.base_url.endswith("/v1")
        assert httpx.get(server.base_url.removesuffix("/v1") + "/health", timeout=5).status_code == 200


def test_a_serving_host_that_does_not_resolve_is_one_line_not_a_traceback(monkeypatch):
    def no_name(*a, **k):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_name)
    with pytest.raises(QuantgateError) as exc:
        free_port("gpu-box.invalid")
    assert str(exc.value) == (
        "host 'gpu-box.invalid' does not resolve to an address (Name or service not known); give one, e.g. 127.0.0.1 "
        "or ::1 (evaluate.serve.host, or the fleet's topology)"
    )  # it said "is no address of this machine": it is no address at all
    for host, hint in (("[::1]", "without the brackets a URL puts around it: ::1"), (" ::1 ", "without the spaces")):
        with pytest.raises(QuantgateError) as exc:
            free_port(host)
        assert str(exc.value).startswith(f"host {host!r} does not resolve to an address (Name or service not known); ")
        assert f"; write it {hint}" in str(exc.value)


def test_a_serving_host_of_no_interface_here_is_named_so(monkeypatch):
    with pytest.raises(QuantgateError) as exc:
        free_port("192.0.2.1")  # TEST-NET-1: no interface has it
    assert str(exc.value).startswith("host '192.0.2.1' is no address of this machine (Cannot assign requested address)")


def test_a_server_quantgate_stops_is_no_death(fake_vllm, tmp_path):
    with fake_vllm("hang", "fp16", tmp_path / "fp16" / "server.log") as server:
        pass
    assert server.exited() and server.death() is None


def test_deaths_turns_the_symptom_into_the_death_and_leaves_other_errors_alone(fake_vllm, tmp_path):
    with fake_vllm("hang", "fp8", tmp_path / "fp8" / "server.log") as server:
        with pytest.raises(ValueError, match="not a death"), server.deaths(wait_s=0.1):
            raise ValueError("not a death")
        engine_error(server)
        os.killpg(server.pid, signal.SIGKILL)
        with pytest.raises(ServerDied, match=rf"^vLLM server for fp8 died with SIGKILL, .*{ENGINE_ERROR}") as info:
            with server.deaths():
                raise requests.ConnectionError("HTTPConnectionPool(host='127.0.0.1'): Connection refused")
        assert isinstance(info.value.__cause__, requests.ConnectionError)


def test_each_server_has_an_ipc_folder_of_its_own_removed_when_it_stops(fake_vllm, tmp_path):
    with fake_vllm("hang", "int8", tmp_path / "int8" / "server.log") as server:
        env = psutil.Process(server.pid).environ()
        ipc = Path(env["VLLM_RPC_BASE_PATH"])
        assert ipc.name.startswith("quantgate-vllm-ipc-") and ipc.parent == Path(tempfile.gettempdir())
        assert [p.name for p in ipc.iterdir()] == [f"fake-{server.pid}"]  # the stand-in's socket
    assert not ipc.exists()


def test_the_orphan_guard_kills_the_server_and_removes_its_ipc_folder_when_the_stage_is_killed(tmp_path):
    ipc = tmp_path / "ipc"
    ipc.mkdir()
    (ipc / "socket").touch()
    stage = (
        "import subprocess, sys, time\n"
        "from quantgate.serving import orphan_guard\n"
        "server = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        f"orphan_guard(server.pid, {str(ipc)!r})\n"
        "print(server.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", stage], cwd=REPO, stdout=subprocess.PIPE, text=True)
    server = int(proc.stdout.readline())
    assert psutil.pid_exists(server) and ipc.exists()
    proc.kill()  # SIGKILL: no finally runs in the stage
    proc.wait()

    def alive(pid: int) -> bool:  # a killed orphan may stay a zombie until its new parent reaps it
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 20
    while (ipc.exists() or alive(server)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(server) and not ipc.exists()


def test_a_remote_endpoint_never_dies_here(tmp_path):
    remote = Server(base_url="http://10.0.0.5:8000/v1", name="fp8@sha256:" + "0" * 64, log_path=tmp_path / "e.json")
    assert not remote.exited() and remote.death(wait_s=0.1) is None
    with pytest.raises(requests.ConnectionError), remote.deaths(wait_s=0.1):
        raise requests.ConnectionError("refused")


@pytest.mark.parametrize(
    "code, words",
    [(-9, "died with SIGKILL"), (-4, "died with SIGILL"), (1, "exited with code 1"), (0, "exited with code 0")],
)
def test_exit_words_are_the_probes(code, words):
    assert exit_words(code) == words


def test_log_reason_reads_only_what_was_logged_since_ready_and_finds_the_root_cause(tmp_path):
    log = tmp_path / "server.log"
    before = "(APIServer pid=1) WARNING 12-04 09:59:00 [x.py:1] ModuleNotFoundError: No module named 'triton'\n"
    log.write_text(
        before
        + f"(EngineCore_DP0 pid=2) ERROR 12-04 10:07:00 [core.py:842] {ENGINE_ERROR}\n"
        + "(APIServer pid=1) ERROR 12-04 10:07:00 [async_llm.py:480] AsyncLLM output_handler failed.\n"
        + "(APIServer pid=1) INFO:     Shutting down\n"
    )
    assert log_reason(log, len(before)) == ENGINE_ERROR
    assert log_reason(log, log.stat().st_size) == "no error line in its log"
    assert log_reason(tmp_path / "gone.log") == f"no log at {tmp_path / 'gone.log'}"
    # a known cause is read as the start failures read it (serving.HINTS)
    log.write_text("RuntimeError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX\n")
    assert log_reason(log) == serving.hint(log.read_text())


# What vLLM 0.32.0 CPU logged after it was ready, when the test SIGKILLed one of its processes under load
# (2026-12-03, SmolLM2-135M fp16; traceback frames left out)
DEAD_ENGINE_API = (
    "(APIServer pid=10536) ERROR 12-03 10:31:39 [async_llm.py:906] AsyncLLM output_handler failed.\n"
    "(APIServer pid=10536) ERROR 12-03 10:31:39 [async_llm.py:906] Traceback (most recent call last):\n"
    "(APIServer pid=10536) ERROR 12-03 10:31:39 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
    "EngineCore encountered an issue. See stack trace (above) for the root cause.\n"
    "INFO:     Shutting down\n"
    "(APIServer pid=10536) WARNING 12-03 10:31:39 [utils.py:653] [shutdown] Process manager: force killing "
    "remaining process EngineCore pid 10572\n"
)
WORKER_KILLED = (
    "(EngineCore pid=10572) ERROR 12-03 10:31:39 [multiproc_executor.py:315] Worker proc VllmWorker-0 died "
    "unexpectedly (exit code: -9), shutting down executor.\n"
    "(EngineCore pid=10572) ERROR 12-03 10:31:39 [core.py:1512] EngineCore encountered a fatal error.\n"
    "(EngineCore pid=10572) ERROR 12-03 10:31:39 [core.py:1512] Traceback (most recent call last):\n"
    "(EngineCore pid=10572) ERROR 12-03 10:31:39 [core.py:1512] RuntimeError: cancelled\n" + DEAD_ENGINE_API
)
ENGINE_KILLED = (
    "(APIServer pid=9667) WARNING 12-03 10:29:57 [core_client.py:817] [shutdown] MPClient: engine core exited "
    "unexpectedly; starting cleanup\n" + DEAD_ENGINE_API
)
# the fp8 death on an AMX CPU: one engine step outlasted VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
STEP_TIMED_OUT = (
    "(EngineCore_DP0 pid=4410) ERROR 11-30 14:02:11 [core.py:1512] EngineCore encountered a fatal error.\n"
    "(EngineCore_DP0 pid=4410) ERROR 11-30 14:02:11 [core.py:1512] Traceback (most recent call last):\n"
    f"(EngineCore_DP0 pid=4410) ERROR 11-30 14:02:11 [core.py:1512] {ENGINE_ERROR}\n" + DEAD_ENGINE_API
)


@pytest.mark.parametrize(
    "logged, reason",
    [
        (WORKER_KILLED, "vLLM's worker process VllmWorker-0 died with SIGKILL"),
        (ENGINE_KILLED, "vLLM's engine core process exited without logging an error (EngineDeadError)"),
        (STEP_TIMED_OUT, ENGINE_ERROR),  # the root cause above vLLM's EngineDeadError wrapper
    ],
)
def test_vllms_own_death_lines_are_read_for_their_root_cause(tmp_path, logged, reason):
    log = tmp_path / "server.log"
    log.write_text(logged)
    assert log_reason(log) == reason


@pytest.fixture
def scored_project(tmp_path, example_evals, monkeypatch):
    """An fp8 build (tiny safetensors), the example teams, fp16's scores for the gate, and the evaluate stage
    with its cache in tmp_path, its serving record fixed (no serving env) and lm-eval's client a stand-in."""
    monkeypatch.setattr(team_scores, "CACHE_DIR", tmp_path / "cache")
    precision = {"dtype": "float32", "requested": "auto", "why": "auto: test"}
    record = ServingRecord(versions={"vllm": "test"}, dtype="float32", max_model_len=2048, extra_args=[])
    # evaluate asks it (team_scores.scoring_of); so would the profile stage's scoring
    monkeypatch.setattr(team_scores, "serving_config", lambda *a: (precision, record, None))
    monkeypatch.setattr(team_scores, "make_lm", lambda server, *a: server)
    model = safetensors_build(tmp_path / "models" / "fp8", "fp8", seed=1, shards=1)
    for team in ("billing", "search", "support"):
        write_scores(tmp_path / "eval", "fp16", team, [1.0, 0.0, 1.0])
    return SimpleNamespace(model=model, evals=example_evals, eval_dir=tmp_path / "eval", cache=tmp_path / "cache")


def test_evaluate_scores_no_team_on_a_dead_server_and_the_gate_fails_the_build_with_the_death(
    scored_project, fake_vllm, monkeypatch, capsys
):
    from pipeline.gate import gate, load_params
    from quantgate.teams import load_teams
    from registry.tags import gate_tags

    asked = []

    def run_team(server, team, harness):  # the engine dies while the first team is scored
        asked.append(team.name)
        engine_error(server)
        os.killpg(server.pid, signal.SIGKILL)
        raise requests.ConnectionError("HTTPConnectionPool(host='127.0.0.1', port=1): Max retries exceeded")

    monkeypatch.setattr(team_scores, "run_team", run_team)
    monkeypatch.setattr(
        evaluate_stage, "vllm_server", lambda params, model_dir, name, log: fake_vllm("hang", name, log)
    )
    p = scored_project
    out = p.eval_dir / "fp8"
    docs = evaluate("fp8", p.model, p.evals, out, EvaluateParams())
    assert asked == ["billing"]  # no request for the teams after it
    death = docs["billing"].reason
    assert re.fullmatch(
        rf"vLLM server for fp8 died with SIGKILL, \d+ s after it was ready: {ENGINE_ERROR} \(log: {out}/server.log\)",
        death,
    )
    for team in ("billing", "search", "support"):
        doc = TeamScores.model_validate_json((out / team / "scores.json").read_text())
        assert (doc.status, doc.reason) == ("error", death)
    assert not p.cache.exists() or not any(p.cache.iterdir())  # never cached
    said = capsys.readouterr().out
    assert said.count(death) == 1 and "ConnectionError" not in said
    assert "evaluate[fp8]: search: error, not scored: its server died" in said
    assert set(json.loads((out / "timing.json").read_text())["scoring_s"]) == {"billing"}

    result = gate(p.eval_dir, load_teams(p.evals), load_params(REPO / "params.yaml"))
    fp8 = result.builds["fp8"]
    assert fp8.verdict == "FAIL" and not fp8.shippable
    for team in ("billing", "search", "support"):
        assert death in fp8.teams[team].reason
        assert death in gate_tags(fp8, {})[f"gate.{team}.reason"]  # what register records on the build's run


@contextlib.contextmanager
def dies_when_its_engine_fails(fake_vllm, name: str, log: Path):
    """fake_vllm's server, SIGKILLed (its process group) once its engine has logged the error."""
    with fake_vllm("hang", name, log) as server:

        def kill():
            text = log.resolve()  # the test may leave its working directory first
            while not server.exited():
                if ENGINE_ERROR in text.read_text():
                    os.killpg(server.pid, signal.SIGKILL)
                    return
                time.sleep(0.02)

        threading.Thread(target=kill, daemon=True).start()
        yield server


def test_profile_records_the_death_as_the_unprofiled_reason(fake_vllm, tmp_path, monkeypatch):
    import pipeline.measuring as measuring
    import pipeline.profile as stage
    from pipeline.profile import ProfileParams, profile

    def bench(python, base_url, *a):  # vllm bench serve, against an engine that dies under it
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{base_url}/completions", json={"prompt": "x"}, timeout=30)
        raise stage.QuantgateError("vllm bench serve failed (exit 1): ConnectionRefusedError")

    safetensors_build(tmp_path / "models" / "int8", "int8", seed=2, shards=1)
    monkeypatch.chdir(tmp_path)
    served = lambda params, model_dir, name, log: dies_when_its_engine_fails(fake_vllm, name, log)  # noqa: E731
    monkeypatch.setattr(stage, "vllm_server", served)
    monkeypatch.setattr(measuring, "bench_loads", bench)
    monkeypatch.setattr(
        measuring, "resolved", lambda p, model_dir=None: p.model_construct(**{**dict(p), "dtype": "float32"})
    )
    monkeypatch.setattr(measuring, "arithmetic_kv", lambda *a: {"kv_tokens_arithmetic": None})
    monkeypatch.setattr(measuring, "probe", lambda python: SimpleNamespace(is_cpu=True))
    rec = profile("int8", Path("models/int8"), ServeParams(), ProfileParams())
    assert rec.status == "unprofiled"
    # as for a start failure, the profile document leaves the log path (results/logs/profile@<build>.server.log) out
    assert re.fullmatch(
        rf"vLLM server for int8 died with SIGKILL, \d+ s after it was ready: {ENGINE_ERROR}", rec.reason
    )


def test_recording_calibration_stops_with_the_death_of_the_16bit_server(
    fake_vllm, tmp_path, example_evals, monkeypatch
):
    import transformers

    import pipeline.calibrate as stage
    from pipeline.calibrate import CalibrateParams, record

    model = safetensors_build(tmp_path / "models" / "fp16", "fp16", seed=3, shards=1)
    prompts = Path(stage.__file__).parents[1] / CalibrateParams().prompts
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: SimpleNamespace())
    served = lambda params, model_dir, name, log: dies_when_its_engine_fails(fake_vllm, name, tmp_path / "c.log")  # noqa: E731
    monkeypatch.setattr(stage, "vllm_server", served)
    p = CalibrateParams(prompts=str(prompts), samples=2, concurrency=2, recorded=str(tmp_path / "recorded"))
    with pytest.raises(ServerDied) as info:
        record(model, example_evals, p, ServeParams())
    assert re.fullmatch(
        rf"vLLM server for fp16 died with SIGKILL, \d+ s after it was ready: {ENGINE_ERROR} \(log: {tmp_path}/c.log\)",
        str(info.value),
    )
    assert not (tmp_path / "recorded.jsonl").exists() and not (tmp_path / "recorded.json").exists()


def test_the_canary_fleets_say_the_same_words(monkeypatch, tmp_path):
    import canary.local as fleet_mod
    import gateway.fleet as standing
    from canary.policy import Servers
    from tests.test_canary_standing import Fakes, sleep_server

    log = tmp_path / "v3" / "server.log"
    log.parent.mkdir()
    log.write_text("INFO started\n")

    def open_server(stack, source, version, params, role, log_, verified=None):
        backend, server = sleep_server(stack, version, log)
        return backend, server, tmp_path

    # the canary run's fleet
    monkeypatch.setattr(fleet_mod, "open_server", open_server)
    with fleet_mod.LocalServers(None, "m", ServeParams(), Servers(), tmp_path) as fleet:
        fleet.start("3", "candidate", log=lambda line: None)
        assert fleet.alive("3") and fleet.death("3") is None
        with open(log, "a") as f:
            f.write(f"ERROR 12-04 10:07:00 [core.py:842] {ENGINE_ERROR}\n")
        os.killpg(fleet.pids["3"], signal.SIGKILL)
        said = fleet.started["3"].death(wait_s=5)
        assert not fleet.alive("3") and fleet.death("3") == said
        assert re.fullmatch(
            rf"vLLM server for m-v3 died with SIGKILL, \d+ s after it was ready: {ENGINE_ERROR} \(log: .*\)", said
        )

    # `quantgate serve`'s standing fleet: the restart line gives the same death
    f = Fakes(monkeypatch)
    monkeypatch.setattr(standing, "open_server", lambda stack, *a, **k: open_server(stack, *a, **k))
    f.aliases = {"production": "3"}
    standing_fleet, lines = f.fleet(tmp_path), []
    standing_fleet.log = lines.append
    log.write_text("INFO started\n")  # a new server's log, from the top (as vllm_server opens it)
    try:
        standing_fleet.reconcile()
        with open(log, "a") as f_:
            f_.write(f"ERROR 12-04 10:07:00 [core.py:842] {ENGINE_ERROR}\n")
        os.killpg(standing_fleet.status()["3"]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 5
        while not standing_fleet._servers["3"].server.exited() and time.monotonic() < deadline:
            time.sleep(0.05)
        standing_fleet.reconcile()
    finally:
        standing_fleet.close()
    restart = next(line for line in lines if line.endswith("; starting it again"))
    assert re.fullmatch(
        rf"v3: vLLM server for m-v3 died with SIGKILL, \d+ s after it was ready: {ENGINE_ERROR} \(log: .*\); "
        "starting it again",
        restart,
    )
