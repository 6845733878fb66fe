"""Who may approve (issue 18, item 5): a real `mlflow server --app-name basic-auth` on loopback
(sqlite backend, one per module) with per-registered-model permissions: a pipeline account
that registers, a release manager with MANAGE on the model, and a user with the default READ."""

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import cli
from pipeline.register import RegisterParams, register
from quantgate.serving import stop
from registry import aliases, approval, audit, store
from tests.conftest import safetensors_build
from tests.test_register import gate_result, team_summary

MODEL = "auth-model"
ADMIN = ("admin", "admin-password-1")
START_S = 240  # the auth app's first start migrates two databases: ~50 s on a busy 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as(monkeypatch, user: str) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN[1] if user == "admin" else f"{user}-password-1")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The auth server, started for this module and stopped after it; yields its URI."""
    root = tmp_path_factory.mktemp("auth-server")
    (root / "basic_auth.ini").write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{root}/basic_auth.db\n"
        f"admin_username = {ADMIN[0]}\nadmin_password = {ADMIN[1]}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        "auth_cache_ttl_seconds = 300\n"  # one password hash per user, not one per request
    )
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
    env |= {
        "MLFLOW_AUTH_CONFIG_PATH": str(root / "basic_auth.ini"),
        "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-secret",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    log = root / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("mlflow")), "server", "--app-name", "basic-auth"]
            + ["--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--artifacts-destination", str(root / "art")]
            + ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            cwd=root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        yield uri
    finally:
        stop(proc, grace_s=15)


@pytest.fixture(scope="module")
def registry(server, tmp_path_factory):
    """The pipeline account registers fp16 (v1, fallback) and int4 (v2, PASS); the admin makes
    `rm` a release manager: MANAGE on the model, EDIT on the audit experiment. `eve` has READ."""
    from mlflow.server import get_app_client

    root = tmp_path_factory.mktemp("auth-project")
    (root / "params.yaml").write_text("register: {}\n")
    (root / "results/eval").mkdir(parents=True)
    models = root / "models"
    for seed, build in enumerate(("fp16", "int4")):
        safetensors_build(models / build, build, seed, 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("MLFLOW_TRACKING_URI", server)
        _as(mp, "admin")
        admin = get_app_client("basic-auth", tracking_uri=server)
        for user in ("pipeline", "rm", "eve"):
            admin.create_user(user, f"{user}-password-1")
        _as(mp, "pipeline")
        register(
            models,
            gate_result({"int4": "PASS"}),
            "# report",
            root / "results/eval",
            RegisterParams(model_name=MODEL, experiment="builds"),
            {"search": team_summary("5e" * 32)},
        )
        _as(mp, "admin")
        admin.grant_user_permission("rm", "registered_model", MODEL, "MANAGE")
        audit_exp = store.client().get_experiment_by_name(audit.AUDIT_EXPERIMENT).experiment_id
        admin.grant_user_permission("rm", "experiment", audit_exp, "EDIT")
    return root


@pytest.fixture
def as_user(registry, server, monkeypatch):
    """Switch to a user in the project folder; returns an MlflowClient acting as them."""
    monkeypatch.chdir(registry)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)

    def switch(user: str):
        _as(monkeypatch, user)
        return store.client()

    return switch


def _snapshot(client) -> tuple:
    """Everything an approve/promote/rollback could write: version tags, aliases, audit runs, models."""
    exp = client.get_experiment_by_name(audit.AUDIT_EXPERIMENT).experiment_id
    return (
        {mv.version: mv.tags for mv in client.search_model_versions(f"name='{MODEL}'")},
        client.get_registered_model(MODEL).aliases,
        sorted(r.info.run_id for r in client.search_runs([exp])),
        sorted(m.name for m in client.search_registered_models()),
    )


def test_the_authenticated_user_is_recorded_not_the_declared_one(as_user):
    client = as_user("rm")
    result = CliRunner().invoke(cli, ["approve", MODEL, "2", "--reason", "gate PASS", "--by", "mallory"])
    assert result.exit_code == 0, result.output
    assert "recorded as rm, not --by mallory" in result.output
    tags = client.get_model_version(MODEL, "2").tags
    assert (tags[approval.TAG], tags[approval.BY]) == ("approved", "rm")
    result = CliRunner().invoke(cli, ["promote", MODEL, "2", "--expect-production", "none", "--reason", "go"])
    assert result.exit_code == 0, result.output
    assert aliases.current(client, MODEL)["production"] == "2"
    events = [e for e in audit.history(client, MODEL) if e.action in ("approve", "promote")]
    assert [(e.action, e.by, e.alias) for e in events] == [
        ("approve", "rm", None),
        ("promote", "rm", "production"),
        ("promote", "rm", "previous"),
    ]
    run = client.get_run(events[0].run_id)
    assert run.data.tags["mlflow.user"] == "rm"


@pytest.mark.parametrize(
    "args",
    [
        ["approve", MODEL, "2", "--reason", "me too"],
        ["promote", MODEL, "1", "--expect-production", "2", "--reason", "mine"],
        ["rollback", MODEL, "--reason", "mine", "--to", "fallback"],
    ],
    ids=["approve", "promote", "rollback"],
)
def test_a_user_without_permission_is_refused_and_nothing_is_written(as_user, args):
    client = as_user("eve")
    before = _snapshot(client)
    result = CliRunner().invoke(cli, [*args, "--by", "eve"])
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [
        f"Error: eve may not {args[0]} {MODEL}: the MLflow server grants eve READ on it and {args[0]} needs "
        "EDIT or MANAGE (ask an MLflow admin); nothing was changed"
    ]
    assert _snapshot(client) == before


def test_the_server_itself_refuses_a_direct_write_by_a_reader(as_user):
    from mlflow.exceptions import MlflowException

    client = as_user("eve")
    before = client.get_model_version(MODEL, "2").tags.get(approval.BY)  # "rm" once the approve test has run
    with pytest.raises(MlflowException) as refused:  # quantgate's check mirrors this: never the only guard
        client.set_model_version_tag(MODEL, "2", approval.BY, "eve")
    assert refused.value.error_code == "PERMISSION_DENIED" and "403" in refused.value.message
    assert client.get_model_version(MODEL, "2").tags.get(approval.BY) == before != "eve"
