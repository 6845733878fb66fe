"""A real `mlflow server` on loopback for tests (sqlite backend, local artifacts): the registry
contract (tests/test_registry_contract.py) and registry webhooks (tests/test_canary_webhook.py)."""

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from quantgate.serving import free_port

SERVER_START_S = 180  # a cold `mlflow server` takes ~20 s on a busy 2-core machine


@dataclass
class Server:
    proc: subprocess.Popen
    uri: str
    artifacts: Path
    log: Path

    def wait_ready(self) -> None:
        """Return once /health answers 200; fail the test with the server's log if it exits or takes too long."""
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"mlflow server exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        pytest.fail(f"mlflow server not healthy after {SERVER_START_S} s:\n{self.log.read_text()[-3000:]}")


@contextlib.contextmanager
def mlflow_server(root: Path, env: dict[str, str] | None = None) -> Iterator[Server]:
    """Launch `mlflow server` on 127.0.0.1 at a free port with its store under `root` and `env` added
    to this process's environment; yields at once (call wait_ready() before using it), stops it on exit."""
    full_env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    full_env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no background job runner processes
    full_env.update(env or {})
    port = free_port()
    log = root / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                str(Path(sys.executable).with_name("mlflow")),
                "server",
                "--backend-store-uri",
                f"sqlite:///{root}/mlflow.db",
                "--artifacts-destination",
                str(root / "artifacts"),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
            ],
            cwd=root,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield Server(proc, f"http://127.0.0.1:{port}", root / "artifacts", log)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
