"""Helpers shared by the benchmark scripts: scratch projects, measured commands, machine
facts, and one output format (a printed table plus benchmarks/results/<name>.json).

Every script runs from the repository root after `make setup`:
`.venv/bin/python -m benchmarks.<script> [options]`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import psutil
import yaml
from rich.console import Console
from rich.table import Table

from quantgate.errors import QuantgateError
from quantgate.precision import model_config, model_context
from quantgate.results import rounded  # noqa: F401 (the benchmarks' own name for it)
from quantgate.serving import check_cpu_cores

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
ENVS = (".venv", ".venv-serve")
SCRATCH_COMMIT = "scratch project"


def project_env() -> dict[str, str]:
    """Environment for commands run in a scratch project: the pipeline env first on PATH,
    no MLFLOW_TRACKING_URI, so each project uses its own sqlite registry, and DVC's analytics off
    (DVC_NO_ANALYTICS: a project's `dvc init` runs before its config can say so, and its daemon
    leaves a temporary file and tries the network)."""
    env = dict(os.environ, PATH=f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}", DVC_NO_ANALYTICS="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def path_arg(text: str) -> Path:
    """argparse type of a folder or file option: a Path, refused when empty ('', e.g. an unset shell variable),
    which Path would read as "." (a scratch project, a build or a server log made in the working directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty; give a path (or drop the option for its default)")
    return Path(text)


def counts_arg(text: str) -> list[int]:
    """argparse type of a list of counts: whole numbers >= 1, comma-separated ("1,8,32")."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers >= 1 separated by commas, e.g. 1,8,32")
    return values


def cpu_cores_arg(text: str) -> str:
    """argparse type of --cpu-cores: a core list this process may use (quantgate.serving.check_cpu_cores), checked
    before any work; the benchmarks set it with model_copy, which runs no validator, so vLLM met a typo at start."""
    try:
        return check_cpu_cores(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def scratch_project(root: Path, *, limit: int | None = None, params: dict | None = None) -> Path:
    """Copy the working tree (tracked and untracked, not ignored files) to `root`, link the two
    environments in, set `evaluate.harness.limit` (docs per task; None keeps params.yaml's)
    and merge `params` ({block: {key: value}}, one level deep) into params.yaml, then commit
    it as a fresh git repository so `dvc repro` runs there as in a clone.

    Raises QuantgateError if `root` exists or cannot be created.
    """
    if root.exists():
        raise QuantgateError(f"{root} already exists; give another --work folder or delete it")
    try:
        root.mkdir(parents=True)
    except OSError as exc:
        raise QuantgateError(f"cannot create {root}: {exc.strerror}; give another --work folder") from None
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    for f in files:
        if (REPO / f).is_file():
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, root / f)
    for env in ENVS:
        (root / env).symlink_to(REPO / env)
    doc = yaml.safe_load((root / "params.yaml").read_text())
    if limit is not None:
        doc["evaluate"]["harness"]["limit"] = limit
    for block, values in (params or {}).items():
        doc[block].update(values)
    (root / "params.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    commit(root, SCRATCH_COMMIT)
    return root


def is_scratch_project(root: Path) -> bool:
    """True if `root` was made by scratch_project (its first commit says so): benchmarks that
    change params.yaml and commit must never run in a real checkout."""
    if root.resolve() == REPO or not (root / "dvc.yaml").is_file() or not (root / ".git").is_dir():
        return False
    log = subprocess.run(["git", "log", "--reverse", "--format=%s"], cwd=root, capture_output=True, text=True)
    return log.returncode == 0 and log.stdout.splitlines()[:1] == [SCRATCH_COMMIT]


def commit(root: Path, message: str) -> None:
    """Commit everything in `root` (git needs no identity configured)."""
    for cmd in (
        ["init", "-q"],
        ["add", "-A"],
        ["-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qm", message, "--allow-empty"],
    ):
        subprocess.run(["git", *cmd], cwd=root, check=True, capture_output=True)


@dataclass(frozen=True)
class Measured:
    """One command: wall seconds, peak resident memory of its whole process tree (GiB, the
    sum over processes, sampled every `interval` s), exit status and output."""

    wall_s: float
    peak_rss_gib: float
    rc: int
    output: str


def measure(cmd: list[str] | str, cwd: Path, *, interval: float = 0.2, timeout: float = 7200) -> Measured:
    """Run `cmd` in `cwd` with project_env() and measure it (see Measured).

    Peak RSS is sampled, so a spike shorter than `interval` can be missed; the vLLM server,
    a child of the stage, is included while it runs. Raises subprocess.TimeoutExpired. On any exit
    before `cmd` ends (the timeout, Ctrl-C, SIGTERM under run_main) its whole process group is stopped:
    it runs in a session of its own, which a terminal's Ctrl-C does not reach.
    """
    started = time.monotonic()
    log = (cwd / ".bench-cmd.log").open("w+")
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=project_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        shell=isinstance(cmd, str),
        start_new_session=True,
    )
    ps, peak = psutil.Process(proc.pid), 0
    try:
        while proc.poll() is None:
            if time.monotonic() - started > timeout:
                raise subprocess.TimeoutExpired(cmd, timeout)
            try:
                procs = [ps, *ps.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in procs if p.is_running()))
            except psutil.Error:
                pass  # a process ended between listing and reading it
            time.sleep(interval)
    except BaseException:  # a timeout, Ctrl-C or SIGTERM (run_main): its own session hears neither signal
        _stop_group(proc)
        raise
    wall = time.monotonic() - started
    log.seek(0)
    return Measured(round(wall, 1), round(peak / 2**30, 2), proc.returncode, log.read())


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop `proc`'s process group (a measured command started in its own session, with every child it
    started: DVC's stage, a vLLM server): SIGTERM, then SIGKILL after 10 s; reaps `proc`."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break  # the group is gone
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue


def machine() -> dict:
    """What the numbers were measured on: CPU, cores, ISA level, memory, GPU, versions."""
    cpu = ""
    flags = ""
    if Path("/proc/cpuinfo").exists():
        info = Path("/proc/cpuinfo").read_text()
        cpu = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
        flags = info
    gpu = ""
    if shutil.which("nvidia-smi"):
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    from quantgate.serving import serving_versions

    try:
        versions = serving_versions(str(REPO / ".venv-serve" / "bin" / "python"))
    except Exception as exc:  # the serving env is optional for some scripts
        versions = {"error": str(exc)}
    return {
        "cpu": cpu or platform.processor(),
        "cores": os.cpu_count(),
        "isa": "avx512" if " avx512f" in flags else ("avx2" if " avx2" in flags else "other"),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": gpu or None,
        "python": platform.python_version(),
        "serving": versions,
    }


def report(name: str, title: str, rows: list[dict], *, meta: dict | None = None, notes: list[str] = ()) -> Path:
    """Print `rows` (dicts with the same keys, in order) as a table under `title`, then write
    benchmarks/results/<name>.json with the rows, the machine, the command line, `meta`
    (settings of the run) and `notes`. Returns the JSON path."""
    table = Table(title=title)
    columns = list(rows[0]) if rows else []
    for col in columns:
        table.add_column(
            col,
            justify="left"
            if col in ("stage", "build", "team", "scenario", "engine", "note", "notes", "reason")
            else "right",
        )
    for row in rows:
        table.add_row(*("" if row.get(c) is None else str(row.get(c)) for c in columns))
    console = Console(width=160)
    console.print(table)
    for note in notes:
        console.print(f"  {note}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.json"
    out.write_text(
        json.dumps(
            {
                "benchmark": name,
                "title": title,
                "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "command": " ".join(["python -m", f"benchmarks.{name}", *sys.argv[1:]]),
                "machine": machine(),
                "settings": meta or {},
                "rows": rows,
                "notes": list(notes),
            },
            indent=1,
        )
        + "\n"
    )
    console.print(f"  written {out.relative_to(REPO)}")
    return out


def stages(root: Path) -> list[str]:
    """The DVC stage names of the project at `root` in the order `dvc repro` runs them, `foreach` expanded
    (`evaluate@fp8`): what `dvc repro --dry --force` plans (no command runs). Not dvc.yaml's file order: the
    search needs profile@fp16 and profile@int4 first, and `--single-item` runs no stage before its own.
    Like any DVC command it takes the project's lock (.dvc/tmp/lock): not while a `dvc repro` runs there.
    Raises QuantgateError with DVC's last line if it cannot plan."""
    proc = subprocess.run(
        ["dvc", "repro", "--dry", "--force"], cwd=root, env=project_env(), capture_output=True, text=True
    )
    names = re.findall(r"Running stage '([^']+)'", proc.stdout)
    if proc.returncode != 0 or not names:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        raise QuantgateError(f"dvc repro --dry in {root} planned no stage: {tail[-1] if tail else 'no output'}")
    return names


def stage_timing(project: Path, stage: str) -> dict | None:
    """The timing a server stage wrote (server_start_s, profile_s or profile_failed_s, scoring_s per team):
    evaluate@<build>'s results/eval/<build>/timing.json, profile@<build>'s results/logs/profile@<build>.timing.json
    (it scores the teams for evaluate@<build> on its server when it starts first: one server per build,
    pipeline/README.md);
    None for another stage, or a profile on Ray (no timing written)."""
    kind, _, build = stage.partition("@")
    path = {
        "evaluate": project / "results" / "eval" / build / "timing.json",
        "profile": project / "results" / "logs" / f"profile@{build}.timing.json",
    }.get(kind)
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def hf_lm(model_dir: Path, params, batch_size: int | None = None):
    """lm-eval's in-process `hf` model for a build folder, with the evaluate stage's dtype,
    batch size and BOS setting (`params`: pipeline.evaluate.EvaluateParams), on CUDA if there
    is one, else CPU (HFLM's default device is cuda). transformers loads compressed-tensors
    fp8 and W4A16 checkpoints and decompresses them; fp8 activations stay quantized per token."""
    import torch
    from lm_eval.models.huggingface import HFLM

    max_length = params.serve.max_model_len
    if max_length == -1:  # vLLM fits it at start, at most the model's own context
        config = model_config(model_dir, "cannot resolve max_model_len -1")
        max_length = model_context(config, f"{model_dir}/config.json")
    return HFLM(
        pretrained=str(model_dir),
        dtype=params.serve.dtype,
        batch_size=batch_size or params.harness.batch_size,
        device="cuda" if torch.cuda.is_available() else "cpu",
        add_bos_token=params.harness.add_bos_token,
        max_length=max_length,
    )  # the context the vLLM engine gets


SERVING_RESOURCE = "quantgate_serving"  # the custom resource of the loopback cluster's serving node


@dataclass(frozen=True)
class LocalRay:
    """A Ray cluster on loopback: `address` of the head; the serving node's node manager port (to find and
    kill its raylet) and the folder it was started from (no models/ in it)."""

    address: str
    worker_port: int
    node_folder: Path


def _ray(*args: str, cwd: Path) -> None:
    p = subprocess.run(["ray", *args], cwd=cwd, env=project_env(), capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise QuantgateError(f"ray {' '.join(args[:2])} failed ({p.returncode}): {(p.stderr or p.stdout)[-500:]}")


@contextmanager
def local_ray(folder: Path, serving_cpus: int = 2) -> Iterator[LocalRay]:
    """Start a head with no serving resource and a second node (`ray start --address`) with `serving_cpus`
    CPUs and as many units of SERVING_RESOURCE, both on 127.0.0.1 with object stores capped at 100 MB; stop
    every Ray process of this machine on every exit path (`ray stop --force`)."""
    from quantgate.serving import free_port

    head, node = folder / "head", folder / "node"
    head.mkdir(parents=True)
    node.mkdir()
    port, worker_port = free_port(), free_port()
    common = ("--node-ip-address", "127.0.0.1", "--object-store-memory", "100000000", "--disable-usage-stats")
    try:
        _ray("start", "--head", "--port", str(port), "--num-cpus", "1", "--include-dashboard=false", *common, cwd=head)
        resources = json.dumps({SERVING_RESOURCE: serving_cpus})
        _ray(
            *("start", "--address", f"127.0.0.1:{port}", "--num-cpus", str(serving_cpus), "--resources", resources),
            *("--node-manager-port", str(worker_port), *common),
            cwd=node,
        )
        yield LocalRay(f"127.0.0.1:{port}", worker_port, node)
    finally:
        from quantgate.executor import disconnect

        disconnect()
        subprocess.run(["ray", "stop", "--force"], env=project_env(), capture_output=True, timeout=120)
