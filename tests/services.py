"""Real services for the scale-out tests, each a process on 127.0.0.1 that the tests start and stop:
PostgreSQL (the machine's PostgreSQL binaries), an S3-compatible object store (moto's server, with
IAM authentication on, so wrong credentials are refused as S3 refuses them) and `mlflow server`.
Session fixtures in tests/conftest.py start PostgreSQL and the object store once per test session."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SERVER_START_S = 180  # a cold `mlflow server` takes ~20 s on a busy 2-core machine (~40 s on PostgreSQL)
BUCKET = "quantgate"
REGION = "us-east-1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, log: Path, timeout_s: float = 60) -> None:
    """Wait until `port` accepts connections (a bare connect: no request is spent); fail with the log
    if the process exits or the port stays closed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[0]} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    pytest.fail(f"{proc.args[0]} did not listen on {port} within {timeout_s} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Stop a process group started with start_new_session=True; SIGKILL after 15 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# --- PostgreSQL ---------------------------------------------------------------------------------


def postgres_bin() -> Path | None:
    """The folder of the machine's PostgreSQL server binaries (initdb, postgres), or None."""
    found = shutil.which("initdb")
    if found and shutil.which("postgres"):
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))  # Debian keeps them off PATH
    return Path(versions[-1]).parent if versions else None


@dataclass
class Postgres:
    proc: subprocess.Popen
    port: int
    data: Path

    @property
    def uri(self) -> str:
        """The SQLAlchemy URI of database `mlflow` (user `quantgate`, trusted on loopback only)."""
        return f"postgresql://quantgate@127.0.0.1:{self.port}/mlflow"


def start_postgres() -> Postgres:
    """initdb a fresh cluster in a temporary folder, start `postgres` on a free loopback port and
    create database `mlflow`. PostgreSQL refuses to run as root, so as root it runs as the
    `postgres` (else `nobody`) user, which owns the folder."""
    import psycopg

    bindir = postgres_bin()
    data = Path(tempfile.mkdtemp(prefix="quantgate-pg-"))
    user = None
    if os.geteuid() == 0:
        user = next((u for u in ("postgres", "nobody") if _has_user(u)), None)
        shutil.chown(data, user)
    log = data / "postgres.log"
    port = free_port()
    subprocess.run(
        [bindir / "initdb", "-D", data / "db", "-U", "quantgate", "-A", "trust", "-E", "UTF8", "--no-sync"],
        check=True,
        capture_output=True,
        user=user,
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            # loopback only, the socket in the data folder, fsync off: a test database
            [bindir / "postgres", "-D", data / "db", "-h", "127.0.0.1", "-p", str(port), "-k", data, "-F"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            user=user,
        )
    wait_port(port, proc, log)
    deadline = time.monotonic() + 30
    while True:  # the port opens before the database accepts connections
        try:
            with psycopg.connect(f"postgresql://quantgate@127.0.0.1:{port}/postgres", autocommit=True) as conn:
                conn.execute("CREATE DATABASE mlflow")
            break
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
    return Postgres(proc, port, data)


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


# --- S3-compatible object store (moto server) -----------------------------------------------------


@dataclass
class ObjectStore:
    proc: subprocess.Popen
    endpoint: str
    key_id: str
    secret: str
    bucket: str = BUCKET

    def env(self) -> dict[str, str]:
        """What an S3 client (MLflow's, DVC's) needs to reach this store: MLFLOW_S3_ENDPOINT_URL
        and an IAM user's access key."""
        return {
            "MLFLOW_S3_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": REGION,
        }

    def client(self):
        """A boto3 S3 client with this store's valid credentials."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=self.key_id,
            aws_secret_access_key=self.secret,
        )


NO_AUTH_SETUP_CALLS = 3  # create_user, put_user_policy, create_access_key; every later request is authenticated


def start_object_store(root: Path) -> ObjectStore:
    """moto's S3 server on a free loopback port with IAM authentication: one IAM user allowed s3:*,
    its access key, and bucket `quantgate`. A request signed with another key or secret gets S3's
    InvalidAccessKeyId / SignatureDoesNotMatch."""
    import boto3

    port = free_port()
    log = root / "moto.log"
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(NO_AUTH_SETUP_CALLS))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_port(port, proc, log)
    endpoint = f"http://127.0.0.1:{port}"
    iam = boto3.client(
        "iam", endpoint_url=endpoint, region_name=REGION, aws_access_key_id="setup", aws_secret_access_key="setup"
    )
    iam.create_user(UserName="quantgate")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    iam.put_user_policy(UserName="quantgate", PolicyName="s3", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="quantgate")["AccessKey"]
    store = ObjectStore(proc, endpoint, key["AccessKeyId"], key["SecretAccessKey"])
    store.client().create_bucket(Bucket=BUCKET)
    return store


# --- mlflow server --------------------------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen
    uri: str
    log: Path

    def wait_ready(self) -> None:
        """Wait for /health (the server was launched in the background); fail with its log."""
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


def launch_mlflow_server(root: Path, backend_uri: str, artifacts: list[str], env: dict[str, str]) -> Server:
    """`mlflow server` on 127.0.0.1 with `backend_uri` and the artifact options `artifacts`, started
    in the background (call wait_ready); `env` is added to the server's environment."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | env
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no background job runner processes
    log = root / "server.log"
    cmd = [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", backend_uri, *artifacts]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*cmd, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            cwd=root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Server(proc, f"http://127.0.0.1:{port}", log)


@contextlib.contextmanager
def sqlite_mlflow_server(root: Path, env: dict[str, str] | None = None) -> Iterator[Server]:
    """`mlflow server` over sqlite under `root` with local artifacts (root/artifacts), `env` added to
    its environment; yields at once (call wait_ready() before using it) and stops it on exit."""
    server = launch_mlflow_server(
        root, f"sqlite:///{root}/mlflow.db", ["--artifacts-destination", str(root / "artifacts")], env or {}
    )
    try:
        yield server
    finally:
        stop(server.proc)
