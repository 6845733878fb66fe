"""Registry defects found by trying quantgate as a new user would (issue 18, item 7), each against a
real embedded sqlite registry (the 503 test: a real HTTP server on loopback that answers 503)."""

import contextlib
import http.server
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import cli
from pipeline.register import RegisterParams, register
from quantgate.errors import QuantgateError
from registry import aliases, approval, audit, lock, runs, store, versions
from registry.status import status_lines
from tests.conftest import safetensors_build
from tests.test_register import gate_result, team_summary

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> Path:
    models = tmp_path_factory.mktemp("builds")
    for seed, build in enumerate(("fp16", "int4", "fp8")):
        safetensors_build(models / build, build, seed, 1)
    return models


@pytest.fixture
def reg(builds, tmp_path, monkeypatch, request):
    """register(verdicts) -> (client, model, register stage output) in a fresh sqlite registry."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("register: {}\n")
    (tmp_path / "results/eval").mkdir(parents=True)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    model = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")

    def run(verdicts: dict[str, str]):
        out = register(
            builds,
            gate_result(verdicts),
            "# report",
            tmp_path / "results/eval",
            RegisterParams(model_name=model, experiment="builds"),
            {"search": team_summary("5e" * 32)},
        )
        return store.client(), model, out

    return run


def _invoke(*args: str):
    result = CliRunner().invoke(cli, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def _one_line_error(result, *fragments: str) -> None:
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len([x for x in lines if x.startswith("Error")]) == 1 and "Traceback" not in result.output, result.output
    for f in fragments:
        assert f in result.output, result.output


def test_overlong_reason_is_refused_before_anything_is_written(reg):
    client, model, out = reg({"int4": "PASS"})
    v = str(out["builds"]["int4"]["version"])
    approval.approve(client, model, v, "alice", "gate PASS")
    before = client.get_model_version(model, v).tags
    n_events = len(audit.history(client, model))
    result = _invoke("approve", model, v, "--reason", "x" * 102_400, "--by", "zoë")
    assert result.exit_code == 2, result.output  # a bad argument: click's usage error, before the registry is read
    assert result.output.splitlines()[-1] == (
        "Error: Invalid value for '--reason': 102400 characters; the registry keeps at most 5000: shorten it (link to "
        "a longer document)"
    )
    for option in ("--override", "--recommend"):
        result = _invoke("approve", model, v, "--by", "zoë", "--reason", "r", option, "x" * 5001)
        assert result.exit_code == 2 and result.output.splitlines()[-1] == (
            f"Error: Invalid value for '{option}': 5001 characters; the registry keeps at most 5000: shorten it (link "
            "to a longer document)"
        ), result.output
    result = _invoke("approve", model, v, "--reason", "fine", "--by", "z" * 6000)
    # a name is not linked to a document: advice that fits the field
    assert result.exit_code == 2 and result.output.splitlines()[-1] == (
        "Error: Invalid value for '--by': 6000 characters; the registry keeps at most 250: give a shorter name, e.g. "
        "--by alice"
    ), result.output
    assert "document" not in result.output
    assert client.get_model_version(model, v).tags == before  # still alice's approval, whole
    assert approval.approval_of(client, model, v).by == "alice"
    exp = client.get_experiment_by_name(audit.AUDIT_EXPERIMENT)
    assert len(client.search_runs([exp.experiment_id])) == n_events  # no FAILED audit run either


def test_recorded_text_is_one_line_and_a_blank_override_is_named(reg):
    """A newline in --reason once printed as a second, forged-looking `history` line; a blank --override
    read as a missing one ("needs --override REASON")."""
    client, model, out = reg({"int4": "FAIL", "fp8": "PASS"})
    v = str(out["builds"]["fp8"]["version"])
    result = _invoke("approve", model, v, "--by", "alice", "--reason", "ok\nproduction=v99 by admin: forged\t!")
    assert result.exit_code == 0, result.output
    assert approval.approval_of(client, model, v).reason == "ok production=v99 by admin: forged !"
    lines = _invoke("history", model).output.splitlines()
    assert not any(line.startswith("production=v99") for line in lines) and any("forged !" in x for x in lines)
    # a name is recorded as given: one with a newline is refused, not rewritten
    forged = "alice\n2026-12-03T00:00:00.000+00:00 approve v2 by security-team: ok"
    result = _invoke("revoke", model, v, "--by", forged, "--reason", "r")
    assert result.exit_code == 2 and result.output.splitlines()[-1] == (
        "Error: Invalid value for '--by': must be one line of printable characters (it is recorded), e.g. --by alice"
    ), result.output
    assert not any("security-team" in x for x in _invoke("history", model).output.splitlines())
    n_events = len(audit.history(client, model))
    for args in (
        ["approve", model, v, "--by", "a", "--reason", "r"],
        ["register", out["unregistered"]["int4"]["run_id"], "--by", "a"],
    ):
        for blank in ("", "   ", "\n"):
            result = _invoke(*args, "--override", blank)
            assert result.exit_code == 2 and result.output.splitlines()[-1] == (
                "Error: Invalid value for '--override': it is empty; say why (it is recorded)"
            ), result.output
    for option in ("--reason", "--recommend"):
        result = _invoke("approve", model, v, "--by", "a", "--reason", "r", option, " \t")
        assert result.exit_code == 2 and result.output.splitlines()[-1] == (
            f"Error: Invalid value for '{option}': it is empty; say why (it is recorded)"
        ), result.output
    assert len(audit.history(client, model)) == n_events  # nothing written


def test_a_failed_tag_write_restores_the_previous_approval(reg):
    client, model, out = reg({"int4": "PASS"})
    v = str(out["builds"]["int4"]["version"])
    approval.approve(client, model, v, "alice", "gate PASS")
    before = client.get_model_version(model, v).tags

    class FailsOnReason:  # the real client, whose write of approval.reason fails (a dropped connection)
        def __getattr__(self, name):
            return getattr(client, name)

        def set_model_version_tag(self, name, version, key, value):
            if key == approval.REASON:
                raise ConnectionError("connection reset")
            client.set_model_version_tag(name, version, key, value)

    with pytest.raises(ConnectionError):
        approval.approve(FailsOnReason(), model, v, "zoë", "new reason")
    assert client.get_model_version(model, v).tags == before
    assert [e.by for e in audit.history(client, model) if e.action == "approve"] == ["alice"]


class _Unavailable(http.server.BaseHTTPRequestHandler):
    def _answer(self):
        body = b"upstream connect error: no healthy upstream"
        self.send_response(503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def unavailable_uri():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_server_answering_503_is_reported_quickly_with_its_error(unavailable_uri, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", unavailable_uri)
    for args in (("status", "m"), ("history", "m"), ("approve", "m", "1", "--reason", "r", "--by", "a")):
        t0 = time.monotonic()
        result = _invoke(*args)
        took = time.monotonic() - t0
        _one_line_error(result, f"MLflow server at {unavailable_uri} answered 503", "no healthy upstream")
        assert "not registered" not in result.output and took < 10, (args, took)


@pytest.mark.parametrize(
    ("env", "said"),
    [
        (
            {"MLFLOW_TRACKING_URI": "sqlite:///{tmp}/notdb"},
            "MLFLOW_TRACKING_URI: {tmp}/notdb is not an SQLite database (no SQLite header); point MLFLOW_TRACKING_URI "
            "at the registry's mlflow.db",
        ),
        (
            {"MLFLOW_TRACKING_URI": "sqlite:///{tmp}"},
            "MLFLOW_TRACKING_URI: {tmp} is a folder, not an SQLite database; point MLFLOW_TRACKING_URI",
        ),
        (
            {"MLFLOW_TRACKING_URI": "mysql://x:secret@127.0.0.1:9/db"},
            "MLFLOW_TRACKING_URI mysql://x:***@127.0.0.1:9/db: its database driver MySQLdb is not installed here; "
            "install it, or use a sqlite:///, postgresql:// or http(s):// registry",
        ),
        (
            {"MLFLOW_TRACKING_URI": "https://[::1"},
            "MLFLOW_TRACKING_URI 'https://[::1' is not a usable URL (Invalid port: ':1'); give the MLflow server's "
            "http(s)://HOST:PORT",
        ),
        ({"MLFLOW_TRACKING_URI": "http://"}, "MLFLOW_TRACKING_URI 'http://' is not a usable URL (no host)"),
        (
            {"MLFLOW_TRACKING_URI": "SQLITE:///{tmp}/mlflow.db"},
            "MLFLOW_TRACKING_URI SQLITE:///{tmp}/mlflow.db: SQLAlchemy (so MLflow's database store) reads the scheme "
            "in lower case only; give sqlite:///{tmp}/mlflow.db",
        ),
        (
            {"MLFLOW_TRACKING_URI": "PostgreSQL+psycopg://x:secret@127.0.0.1:9/db"},
            "MLFLOW_TRACKING_URI PostgreSQL+psycopg://x:***@127.0.0.1:9/db: SQLAlchemy (so MLflow's database store) "
            "reads the scheme in lower case only; give postgresql+psycopg://x:***@127.0.0.1:9/db",
        ),
        (
            {"MLFLOW_TRACKING_URI": "file://{tmp}/mlruns"},
            "MLFLOW_TRACKING_URI 'file://{tmp}/mlruns' is MLflow's file store, which its client refuses (in "
            "maintenance mode) unless MLFLOW_ALLOW_FILE_STORE=true; give sqlite:///<path>/mlflow.db",
        ),
        ({"MLFLOW_TRACKING_URI": "{tmp}/mlruns"}, "MLFLOW_TRACKING_URI '{tmp}/mlruns' is MLflow's file store"),
        ({"MLFLOW_TRACKING_URI": "{tmp}/ml:runs"}, "MLFLOW_TRACKING_URI '{tmp}/ml:runs' is MLflow's file store"),
        ({"MLFLOW_TRACKING_URI": "databricks_runs"}, "MLFLOW_TRACKING_URI 'databricks_runs' is MLflow's file store"),
        ({"MLFLOW_TRACKING_URI": "  "}, "MLFLOW_TRACKING_URI '  ' is blank; unset it for the default registry"),
        ({"MLFLOW_S3_ENDPOINT_URL": "junk"}, "MLFLOW_S3_ENDPOINT_URL 'junk' is not a usable URL (not http:// or"),
        (
            {"MLFLOW_S3_ENDPOINT_URL": "https://[::1"},
            "MLFLOW_S3_ENDPOINT_URL 'https://[::1' is not a usable URL (Invalid port: ':1'); give the S3-compatible "
            "object store's http(s)://HOST:PORT",
        ),
        (
            {"MLFLOW_TRACKING_URI": None, "_default_db": "junk"},
            "the default registry mlflow.db (MLFLOW_TRACKING_URI is unset): {tmp}/mlflow.db is not an SQLite database",
        ),
    ],
)
def test_unusable_registry_settings_are_one_line_naming_the_variable(env, said, reg, tmp_path, monkeypatch):
    """A sqlite file that is no database gave sqlalchemy's DatabaseError traceback (status: with its [SQL: ...] and
    "Background on this error" lines); mysql:// without its driver ModuleNotFoundError; "https://[::1"
    httpx.InvalidURL; MLFLOW_S3_ENDPOINT_URL=junk botocore's ValueError; "http://" was called not reachable;
    SQLITE:///... (HTTP:// works) said SQLAlchemy's "Can't load plugin: sqlalchemy.dialects:SQLITE"."""
    client, model, _ = reg({})  # a working registry first: the setting alone is what fails
    (tmp_path / "notdb").write_text("not a database\n")
    if "_default_db" in env:
        (tmp_path / "mlflow.db").write_text(env["_default_db"])
    for name, value in env.items():
        if name == "_default_db":
            continue
        if value is None:
            monkeypatch.delenv(name)
        else:
            monkeypatch.setenv(name, value.format(tmp=tmp_path))
    for args in (("history", model), ("status", model), ("approve", model, "1", "--reason", "r", "--by", "rm")):
        result = _invoke(*args)
        assert result.exit_code == 1, result.output
        _one_line_error(result, "Error: " + said.format(tmp=tmp_path))
        assert len(result.output.strip().splitlines()) == 1 and "[SQL:" not in result.output, result.output


@pytest.mark.parametrize("kind", ["empty file", "another database"])
def test_a_sqlite_file_without_a_registry_is_refused_and_left_unwritten(kind, tmp_path, monkeypatch):
    """MLFLOW_TRACKING_URI at an empty file or another application's SQLite database: status, history and approve
    (commands that act on a registry `dvc repro` made) had MLflow create its ~30 tables in it ("Creating initial
    MLflow database tables...") and then said the model is not registered."""
    import sqlite3

    db = tmp_path / "other.db"
    db.touch()
    if kind == "another database":
        with contextlib.closing(sqlite3.connect(db)) as c:
            c.execute("CREATE TABLE t (x)")
            c.commit()
    before = db.read_bytes()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    for args in (("history", "m"), ("status", "m"), ("approve", "m", "1", "--reason", "r", "--by", "rm")):
        result = _invoke(*args)
        assert result.exit_code == 1, result.output
        _one_line_error(result, f"Error: no registry in {db}: it is an empty file or another SQLite database")
    assert db.read_bytes() == before


# (URI after sqlite:///{tmp}/, the file SQLAlchemy and so MLflow opens): measured with MLflow 3.17 / SQLAlchemy 2.1
SQLITE_FORMS = [("mlflow.db?mode=ro", "mlflow.db"), ("a%20b.db", "a b.db"), ("a%3Fb.db", "a?b.db")]


@pytest.mark.parametrize(("given", "opened"), [*SQLITE_FORMS, ("mlflow.db?timeout=30", "mlflow.db")])
def test_a_sqlite_uri_with_a_query_or_percent_escapes_finds_the_registry_mlflow_made(given, opened, tmp_path):
    """client(existing=True) looked for the URI's text after sqlite:/// (mlflow.db?mode=ro, a%20b.db) while MLflow,
    through SQLAlchemy, drops the query and decodes %XX: a registry MLflow made was "no registry at"."""
    uri = f"sqlite:///{tmp_path}/{given}"
    store.client(uri).create_registered_model("m")
    assert [p.name for p in tmp_path.iterdir()] == [opened]  # the one file MLflow made
    assert store.client(uri, existing=True).get_registered_model("m").name == "m"
    assert store.sqlite_file(uri) == tmp_path / opened


@pytest.mark.parametrize(("given", "opened"), SQLITE_FORMS)
def test_an_empty_file_where_mlflow_opens_is_refused_though_the_uri_text_names_a_registry(given, opened, tmp_path):
    """With a registry at the URI's literal text (a file named mlflow.db?mode=ro or a%20b.db) and an empty file where
    SQLAlchemy opens, client(existing=True) checked the first and let MLflow write its tables into the second."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(tmp_path / given)) as decoy:
        decoy.execute("CREATE TABLE registered_models (name)")
        decoy.commit()
    (tmp_path / opened).touch()
    with pytest.raises(QuantgateError, match=f"^no registry in {re.escape(str(tmp_path / opened))}: it is an empty"):
        store.client(f"sqlite:///{tmp_path}/{given}", existing=True)
    assert (tmp_path / opened).read_bytes() == b""


@pytest.mark.parametrize("given", ["{tmp}/m.db?uri=true&mode=ro", "file:{tmp}/m.db?mode=ro&uri=true"])
def test_sqlite_uri_filenames_are_refused_before_mlflow_makes_files_named_after_the_text(given, tmp_path, monkeypatch):
    """uri=true hands SQLite the path to read by its own rules: MLflow made a file named "m.db?mode=ro" for the first,
    and folders file:/tmp/... under the working folder for the second, then retried "unable to open" for minutes."""
    monkeypatch.chdir(tmp_path)
    uri = "sqlite:///" + given.format(tmp=tmp_path)
    for existing in (False, True):
        with pytest.raises(
            QuantgateError, match=r"^MLFLOW_TRACKING_URI .*uri=true\) are not supported .* give sqlite:////"
        ):
            store.client(uri, existing=existing)
    assert list(tmp_path.iterdir()) == []


def test_percent_escapes_in_a_sqlite_folder_are_refused_before_mlflow_makes_the_undecoded_folder(tmp_path, monkeypatch):
    """MLflow makes the folder of the URI's text (sp%20dir) while SQLAlchemy opens sp dir/m.db: with no "sp dir" it
    retried "unable to open database file" for about 100 s and left the stray sp%20dir. The default URI of a working
    folder q?x opened a file q beside it."""
    uri = f"sqlite:///{tmp_path}/sp%20dir/m.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    for existing in (False, True):
        with pytest.raises(QuantgateError, match=rf"^MLFLOW_TRACKING_URI {re.escape(uri)}: MLflow makes the folder "):
            store.client(existing=existing)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    (tmp_path / "q?x").mkdir()
    monkeypatch.chdir(tmp_path / "q?x")
    with pytest.raises(
        QuantgateError, match=r"^the default registry .* opens \S+/q \(query cut off.*run from a folder"
    ):
        store.client()
    assert [p.name for p in tmp_path.iterdir()] == ["q?x"] and not any((tmp_path / "q?x").iterdir())


@pytest.mark.parametrize("folder", ["new", "sp%20dir"])
def test_a_sqlite_driver_uri_whose_folder_is_missing_is_refused_at_once(folder, tmp_path):
    """MLflow makes the database's folder for sqlite:/// alone: with sqlite+pysqlite:/// and no such folder (none
    yet, or "sp dir" for sp%20dir) SQLite could not open the file and MLflow retried for about 100 s, then raised
    OperationalError. The same URI with the folder there is used as it is."""
    uri = f"sqlite+pysqlite:///{tmp_path}/{folder}/m.db"
    for existing in (False, True):
        with pytest.raises(QuantgateError, match=rf"^MLFLOW_TRACKING_URI {re.escape(uri)}: there is no folder "):
            store.client(uri, existing=existing)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "new").mkdir()
    store.client(f"sqlite+pysqlite:///{tmp_path}/new/m.db").create_registered_model("m")
    assert [p.name for p in (tmp_path / "new").iterdir()] == ["m.db"]


def test_sqlite_file_is_the_path_sqlalchemy_opens(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert store.sqlite_file("sqlite:///rel/m.db?timeout=5") == tmp_path / "rel/m.db"
    assert store.sqlite_file(f"sqlite+pysqlite:///{tmp_path}/a%2520b.db") == tmp_path / "a%20b.db"  # decoded once
    for uri in ("sqlite://", "sqlite:///:memory:", "http://127.0.0.1:5000", "postgresql://u@h/db"):
        assert store.sqlite_file(uri) is None, uri
    for uri in ("sqlite://", "sqlite:///:memory:"):  # it did say "or set MLFLOW_TRACKING_URI", though it was set
        with pytest.raises(QuantgateError, match="^no registry in MLFLOW_TRACKING_URI .*: an in-memory database lasts"):
            store.client(uri, existing=True)
    with pytest.raises(QuantgateError, match="^MLFLOW_TRACKING_URI is not a usable sqlite URL .*Invalid SQLite URL"):
        store.sqlite_file("sqlite://host/m.db")


def test_a_slash_in_the_options_of_a_sqlite_uri_is_named_not_the_folders(tmp_path, monkeypatch):
    """sqlite:////p/m.db?timeout=30&x=a/b: MLflow makes the folder /p/m.db?timeout=30&x=a; the refusal said "give a
    path with no %XX or ? in its folders", though the path's folders had neither."""
    uri = f"sqlite:///{tmp_path}/m.db?timeout=30&x=a/b"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(QuantgateError) as err:
        store.sqlite_file(uri)
    assert str(err.value) == (
        f"MLFLOW_TRACKING_URI {uri}: MLflow makes the folder {tmp_path}/m.db?timeout=30&x=a (the URI's text as "
        f"written) but SQLAlchemy opens {tmp_path}/m.db (query cut off, %XX decoded); give the options after ? with "
        "no / in them"
    )
    assert list(tmp_path.iterdir()) == []


def test_the_default_registry_in_a_folder_like_an_option_is_told_to_move_not_to_fix_options(tmp_path, monkeypatch):
    """With MLFLOW_TRACKING_URI unset, a working folder q?x=1/sub makes the default sqlite:////.../q?x=1/sub/mlflow.db;
    the refusal told the user to 'give the options after ? with no / in them', options the user never gave."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "q?x=1" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "q?x=1" / "sub")
    with pytest.raises(QuantgateError, match=r"^the default registry .*; run from a folder whose path has no %XX"):
        store.sqlite_file(store.tracking_uri())


def test_a_file_store_mlflow_is_told_to_allow_is_used_and_an_upper_case_http_uri_is_checked(tmp_path, monkeypatch):
    """MLFLOW_ALLOW_FILE_STORE=true is MLflow's own opt-in to its file store: status worked there, then was refused as
    "refused by its client". HTTP://HOST:PORT (MLflow reads schemes in any case) skipped the reachability check, and
    MLflow's client retried for minutes."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "mlruns"))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "True")
    _one_line_error(_invoke("status", "m"), f"model 'm' is not registered at {tmp_path}/mlruns")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "yes")  # MLflow refuses it (ValueError): so does check_settings
    _one_line_error(_invoke("status", "m"), "is MLflow's file store, which its client refuses")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed below: nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"HTTP://127.0.0.1:{port}")
    t0 = time.monotonic()
    result = _invoke("status", "m")
    assert time.monotonic() - t0 < 10
    _one_line_error(result, f"MLflow server at HTTP://127.0.0.1:{port} is not reachable (ConnectError)")


def test_an_mlflow_error_of_several_lines_is_one_line_in_status_as_in_history(monkeypatch):
    """MLFLOW_TRACKING_URI=databricks without credentials: MLflow's message has a newline, and status printed it in
    two lines (history cut it to one)."""
    from mlflow.exceptions import MlflowException

    def refuse(existing=False):
        raise MlflowException("Reading Databricks credential configuration failed.\nFor details, see the docs.")

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "databricks")
    monkeypatch.setattr(store, "client", refuse)
    for args in (("status", "m"), ("history", "m")):
        result = _invoke(*args)
        assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
        _one_line_error(result, "MLflow at databricks: ", "configuration failed. For details, see the docs.")


@pytest.mark.parametrize(
    "args",
    [
        ("canary", "render", "m", "2", "--format", "gateway-api"),
        ("canary", "run", "m", "2", "--by", "rm"),
        ("serve", "m"),
    ],
)
def test_a_registry_mlflow_refuses_is_one_line_in_canary_and_serve_as_in_approve(args, tmp_path, monkeypatch):
    """A tracking URI MLflow has no store for (nonsense://x: UnsupportedModelRegistryStoreURIException), or
    `databricks` without credentials, gave `canary render`, `canary run` and `serve` MLflow's traceback; the
    registry commands said it in one line."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nonsense://x")
    result = _invoke(*args)
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    _one_line_error(result, "Error: MLflow at nonsense://x: ", "unsupported URI 'nonsense://x'")


@pytest.mark.parametrize(
    "args",
    [
        ("approve", "m", "²", "--reason", "r", "--by", "a"),
        ("promote", "m", "²", "--expect-production", "none", "--reason", "r", "--by", "a"),
        ("promote", "m", "1", "--expect-production", "²", "--reason", "r", "--by", "a"),
        ("revoke", "m", "v١", "--reason", "r", "--by", "a"),
    ],
)
def test_unicode_digits_are_not_version_numbers(args, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/none.db")
    result = _invoke(*args)
    assert result.exit_code == 2 and "is not a model version" in result.output, result.output
    with pytest.raises(QuantgateError, match="is not a model version number"):
        versions.version_number("²")


HUGE = "99999999999999999999999"  # past sqlite's 64-bit INTEGER (and every store's 32-bit version column)


def test_a_version_number_no_store_can_hold_does_not_exist(reg):
    """`canary render M 999...` and `canary run` gave sqlite's traceback "Python int too large to convert to SQLite
    INTEGER"; approve, revoke and promote --expect-production printed that internal text with no advice."""
    client, model, out = reg({"int4": "PASS"})
    v = str(out["builds"]["int4"]["version"])
    approval.approve(client, model, v, "rm", "gate PASS")
    Path("params.yaml").write_text(
        "register: {}\ncanary:\n  steps: [5, 25, 50, 100]\nfleet: {}\nevaluate:\n  serve: {}\ncanary_topology: {}\n"
    )
    n_events = len(audit.history(client, model))
    for huge in (HUGE, "9" * 5000):  # 4300+ digits: int() itself raised ValueError
        gone = f"{model} v{huge} does not exist (never registered, or deleted); see `quantgate status {model}`"
        for args in (
            ("approve", model, huge, "--reason", "r", "--by", "rm"),
            ("revoke", model, huge, "--reason", "r", "--by", "rm"),
            ("canary", "render", model, huge, "--format", "gateway-api"),
            ("canary", "run", model, huge, "--by", "rm"),
        ):
            result = _invoke(*args)
            assert result.exit_code == 1, result.output
            _one_line_error(result, gone)
            assert "SQLite" not in result.output
    result = _invoke("canary", "render", model, v, "--format", "gateway-api", "--step", "9" * 5000)
    assert result.exit_code == 2 and "Invalid value for '--step'" in result.output, result.output
    result = _invoke("promote", model, v, "--expect-production", HUGE, "--reason", "r", "--by", "rm")
    _one_line_error(result, f"{model} v{HUGE}, the production you expected, does not exist")
    assert len(audit.history(client, model)) == n_events and "production" not in aliases.current(client, model)
    assert versions.get_version(client, model, str(versions.MAX_VERSION)) is None  # asked: the store says so
    assert str(versions.get_version(client, model, f"v{v}").version) == v


def test_breaking_a_stale_lock_is_said_and_audited(reg, capsys):
    client, model, _ = reg({})
    first = lock.acquire(client, model, "promote v2 by alice", by="alice")
    created = lock.holder_of(client, model)["created"]
    with pytest.raises(lock.LockBusy) as busy:
        lock.acquire(client, model, "bob", wait_s=0.3)
    assert f"lock.at {first_at(client, model)}" in str(busy.value) and f"created {created}" in str(busy.value)
    capsys.readouterr()
    second = lock.acquire(client, model, "approve v3 by carol", by="carol", stale_after_s=-1)
    said = capsys.readouterr().err
    assert "broke a stale registry lock" in said and "promote v2 by alice" in said and f"created {created}" in said
    [event] = [e for e in audit.history(client, model) if e.action == "break_lock"]
    assert (event.action, event.by) == ("break_lock", "carol") and "promote v2 by alice" in event.reason
    assert event.line().endswith(event.reason) and " lock " in event.line()
    second.release()
    first.release()


def first_at(client, model) -> str:
    return lock.holder_of(client, model)["lock.at"]


def test_a_deleted_production_version_is_reported(reg):
    client, model, out = reg({"int4": "PASS"})
    v = str(out["builds"]["int4"]["version"])
    approval.approve(client, model, v, "rm", "gate PASS")
    aliases.promote(client, model, v, None, "rm", "go", verify=False)
    client.delete_model_version(model, v)  # the plain MLflow client, outside quantgate
    lines = status_lines(client, model)
    assert any(f"warning: the audit trail says production=v{v}, but v{v} no longer exists" in x for x in lines), lines
    result = _invoke("history", model, "--at", "now")
    assert result.exit_code == 0, result.output
    assert f"production=none (v{v} per the audit trail, deleted since)" in result.output
    assert f"production=v{v}\n" not in result.output
    past = aliases.audit.history(client, model)[-1].at.isoformat()  # when it was promoted: it existed then
    result = _invoke("history", model, "--at", past)
    assert f"production=v{v} (deleted since)" in result.output, result.output


def test_history_at_a_time_outside_the_calendar_in_utc_is_refused_naming_at(reg):
    """`history M --at 0001-01-01T00:00:00+01:00` (year 0 in UTC) and `9999-12-31T23:00:00-05:00` (year 10000) gave
    the traceback `OverflowError: date value out of range`; the last and first UTC instants still work."""
    client, model, out = reg({"int4": "PASS"})
    fallback = aliases.current(client, model)["fallback"]
    for at in ("0001-01-01T00:00:00+01:00", "9999-12-31T23:00:00-05:00"):
        result = _invoke("history", model, "--at", at)
        assert result.exit_code == 2, result.output
        _one_line_error(
            result, f"Invalid value for '--at': '{at}' is not a usable time: in UTC it falls outside the years 1-9999"
        )
    result = _invoke("history", model, "--at", "9999-12-31T23:59:59+00:00")
    assert result.exit_code == 0 and f"fallback=v{fallback}\n" in result.output, result.output
    result = _invoke("history", model, "--at", "0001-01-01T00:00:00-01:00")  # 01:00 UTC on day one
    assert result.exit_code == 0 and "fallback=none\n" in result.output, result.output


def test_status_into_a_closed_pipe_exits_quietly(reg):
    client, model, _ = reg({"int4": "PASS"})
    p = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {sys.executable} -m cli status {model} | true"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},  # this checkout, not the env's editable install
    )
    assert p.stderr == "" and p.returncode in (0, 1, 141), (p.returncode, p.stderr)


def test_a_purged_build_run_does_not_let_an_edited_verdict_pass(reg, tmp_path):
    client, model, out = reg({"int4": "FAIL"})
    run_id = out["unregistered"]["int4"]["run_id"]
    v = str(runs.register_run(client, run_id, "rm", "ship it anyway").version)
    client.delete_run(run_id)
    gc = subprocess.run(
        [str(Path(sys.executable).with_name("mlflow")), "gc", "--backend-store-uri", store.tracking_uri()],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert gc.returncode == 0, gc.stderr[-2000:]
    client.set_model_version_tag(model, v, "gate.verdict", "PASS")  # edited in the UI
    with pytest.raises(QuantgateError, match=rf"build's run {run_id} is gone"):
        approval.approve(client, model, v, "rm", "looks fine")
    assert approval.approval_of(client, model, v).approved is False
    assert any(f"run {run_id} is gone" in x for x in status_lines(client, model))


def test_database_error_text_is_cut_from_one_line_errors():
    from registry.commands import one_line

    raw = (
        "(psycopg.errors.StringDataRightTruncation) value too long for type character varying(5000)\n"
        "[SQL: INSERT INTO registered_model_tags (key, value, name) VALUES (%(key)s, ...)]"
    )
    assert one_line("API request failed: " + raw) == "API request failed:"
    assert one_line("model version 'x' not found\n  more") == "model version 'x' not found more"


def test_text_limits_fit_every_place_the_text_is_written():
    from mlflow.utils import validation

    # --by goes into the lock's registered-model tag (varchar(5000) on PostgreSQL) as "promote vN by NAME"
    assert approval.MAX_NAME <= validation.MAX_ENTITY_KEY_LENGTH and approval.MAX_NAME + 40 < 5000
    # --reason / --override go into audit params and version tags
    assert audit.MAX_TEXT <= min(validation.MAX_PARAM_VAL_LENGTH, validation.MAX_MODEL_REGISTRY_TAG_VALUE_LENGTH)
    approval.require_text(by="b" * approval.MAX_NAME, reason="r" * audit.MAX_TEXT)  # the limits themselves pass


def test_register_refuses_an_overlong_override_before_writing(reg):
    client, model, out = reg({"int4": "FAIL"})
    run_id = out["unregistered"]["int4"]["run_id"]
    result = _invoke("register", run_id, "--override", "o" * 5001, "--by", "rm")
    assert result.exit_code == 2 and result.output.splitlines()[-1].startswith(
        "Error: Invalid value for '--override': 5001 characters; the registry keeps at most 5000"
    ), result.output
    assert len(client.search_model_versions(f"name='{model}'")) == 1  # the baseline only


def test_a_rollback_to_a_revoked_version_says_where_to_go_instead(reg):
    client, model, out = reg({"int4": "PASS", "fp8": "PASS"})
    v4, v8 = (str(out["builds"][b]["version"]) for b in ("int4", "fp8"))
    for v in (v4, v8):
        approval.approve(client, model, v, "rm", "gate PASS")
    aliases.promote(client, model, v8, None, "rm", "go", verify=False)
    aliases.promote(client, model, v4, v8, "rm", "go", verify=False)  # previous = fp8
    approval.revoke(client, model, v8, "rm", "bad outputs")
    result = _invoke("rollback", model, "--by", "oncall", "--reason", "p99")
    _one_line_error(
        result,
        f"{model} v{v8} (previous) has its approval revoked; go to another version: `quantgate rollback {model} "
        f"--to fallback` (the 16-bit build), or `quantgate promote {model} VERSION` with an approved one",
    )
    assert aliases.current(client, model)["production"] == v4  # nothing moved
    fallback = aliases.current(client, model)["fallback"]
    result = _invoke("revoke", model, fallback, "--by", "rm", "--reason", "test")
    # what the warning says the veto does is what rollback then does (it once said rollbacks still reach it)
    assert result.exit_code == 0 and (
        f"warning: v{fallback} is still 'fallback'; failed requests are still retried on it (the gateway's 16-bit "
        f"baseline), but no rollback goes to it now (`rollback --to fallback` is refused until `quantgate approve "
        f"{model} {fallback}`)"
    ) in result.output.replace("\n", " "), result.output
    _one_line_error(
        _invoke("rollback", model, "--to", "fallback", "--by", "oncall", "--reason", "p99"),
        f"v{fallback} (fallback) has its approval revoked",
    )


def _canary_run(client, model: str, version: str, phase: str, outcome: str | None = None) -> str:
    """A run as canary/controller.py records one (experiment quantgate-canary, its tags)."""
    from canary.status import EXPERIMENT

    exp = store.experiment_id(client, EXPERIMENT)
    run_id = client.create_run(exp, tags={"model": model, "candidate_version": version}).info.run_id
    client.set_tag(run_id, "canary.phase", phase)
    if outcome:
        client.set_tag(run_id, "outcome", outcome)
        client.set_tag(run_id, "outcome.reason", "p99 latency FAIL")
    return run_id


def test_promote_takes_only_a_passed_canary_of_this_version_as_evidence(reg):
    """--canary-run-id once accepted any run: an audit run, a build run, another version's canary, an aborted one."""
    client, model, out = reg({"int4": "PASS", "fp8": "PASS"})
    v4, v8 = (str(out["builds"][b]["version"]) for b in ("int4", "fp8"))
    approval.approve(client, model, v4, "rm", "gate PASS")
    audit_id = client.search_runs([audit.experiment_id(client)], "params.action = 'approve'")[0].info.run_id
    refused = {
        audit_id: "is an audit run (action approve), not a canary run (quantgate-canary)",
        out["builds"]["int4"]["run_id"]: "is a build run (build int4), not a canary run",
        _canary_run(client, model, v8, "promoted", "promoted"): f"is the canary of {model} v{v8}, not of {model} v{v4}",
        _canary_run(client, model, v4, "aborted", "aborted"): "is aborted (p99 latency FAIL); only a canary that "
        "passed every step (canary.phase promoting or promoted) can be given",
        _canary_run(client, model, v4, "progressing"): "is in phase progressing; only a canary that passed",
    }
    from canary.status import EXPERIMENT

    untagged = client.create_run(store.experiment_id(client, EXPERIMENT)).info.run_id  # once "canary of None vNone"
    refused[untagged] = "in quantgate-canary has no model and candidate_version tag, so it is no canary"
    refused["0" * 32] = "does not exist at this tracking URI; give the run id `quantgate canary run` printed for this"
    for run_id, said in refused.items():
        result = _invoke("promote", model, v4, "--expect-production", "none", "--by", "rm", "--reason", "r",
                         "--canary-run-id", run_id)  # fmt: skip
        _one_line_error(result, f"canary run {run_id if run_id != '0' * 32 else repr(run_id)} ", said)
    assert "production" not in aliases.current(client, model)
    passed = _canary_run(client, model, v4, "promoted", "promoted")
    result = _invoke("promote", model, v4, "--expect-production", "none", "--by", "rm", "--reason", "canary clean",
                     "--canary-run-id", passed)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert [e.canary_run_id for e in audit.history(client, model) if e.alias == "production"] == [passed]


def test_a_canary_run_the_registry_failed_to_read_is_not_called_missing(reg, monkeypatch):
    """Any MlflowException of reading --canary-run-id was "does not exist at this tracking URI; give the run id
    `quantgate canary run` printed": a registry that failed (unavailable, locked) sent the user after another id."""

    client, model, out = reg({"int4": "PASS"})
    v4 = str(out["builds"]["int4"]["version"])
    approval.approve(client, model, v4, "rm", "gate PASS")
    run_id = _canary_run(client, model, v4, "promoted", "promoted")
    _registry_busy_for(monkeypatch, run_id)
    for given in (run_id, "0" * 32, "../x"):  # the last two: no such run, not a run id
        result = _invoke("promote", model, v4, "--expect-production", "none", "--by", "rm", "--reason", "r",
                         "--canary-run-id", given)  # fmt: skip
        if given == run_id:
            _one_line_error(result, "Error: MLflow at ", "503: the server is busy")
            assert "does not exist" not in result.output, result.output
        else:
            _one_line_error(result, f"canary run {given!r} does not exist at this tracking URI; give the run id")
    assert "production" not in aliases.current(client, model)


def _registry_busy_for(monkeypatch, run_id: str) -> None:
    """MlflowClient.get_run of `run_id` fails as a registry that cannot answer (TEMPORARILY_UNAVAILABLE); other
    runs are read as before."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    get_run = MlflowClient.get_run

    def unavailable(self, rid):
        if rid == run_id:
            raise MlflowException("503: the server is busy", error_code="TEMPORARILY_UNAVAILABLE")
        return get_run(self, rid)

    monkeypatch.setattr(MlflowClient, "get_run", unavailable)


def test_a_build_run_the_registry_failed_to_read_is_not_called_missing(reg, monkeypatch):
    """Any MlflowException of reading `register RUN_ID` was "run ... does not exist in this registry": a registry
    that failed (unavailable; databricks without credentials) sent the user to `quantgate status` for another id."""

    client, model, out = reg({"int4": "FAIL"})
    run_id = out["unregistered"]["int4"]["run_id"]
    _registry_busy_for(monkeypatch, run_id)
    for given in (run_id, "0" * 32, "../x"):  # the last two: no such run, not a run id
        result = _invoke("register", given, "--by", "rm", "--override", "ship it")
        if given == run_id:
            _one_line_error(result, "Error: MLflow at ", "503: the server is busy")
            assert "does not exist" not in result.output, result.output
        else:
            _one_line_error(result, f"run {given!r} does not exist in this registry; `quantgate status` lists")
    assert runs.registered_as(client, run_id) is None


def test_registry_names_the_canary_experiment_as_canary_does():
    from canary.status import EXPERIMENT

    assert aliases.CANARY_EXPERIMENT == EXPERIMENT  # registry/ does not import canary/: it restates the name


def test_status_of_an_unknown_model_names_the_uri_and_what_to_check(reg):
    """It said "not registered at this tracking URI; run `dvc repro`": dvc repro registers only params.yaml's model."""
    client, model, _ = reg({"int4": "PASS"})
    result = _invoke("status", "nosuchmodel")
    _one_line_error(
        result,
        f"model 'nosuchmodel' is not registered at {store.tracking_uri()}; check the name (params.yaml "
        "register.model_name) or MLFLOW_TRACKING_URI",
    )
    assert "dvc repro" not in result.output
    assert _invoke("history", "nosuchmodel").output == result.output  # the same advice as history's


def test_expecting_a_production_version_that_does_not_exist_says_so(reg):
    """It said "production is none, not v5 as expected; someone else changed it first": nobody did."""
    client, model, out = reg({"int4": "PASS"})
    v = str(out["builds"]["int4"]["version"])
    approval.approve(client, model, v, "rm", "gate PASS")
    result = _invoke("promote", model, v, "--expect-production", "5", "--by", "rm", "--reason", "r")
    _one_line_error(
        result,
        f"{model} v5, the production you expected, does not exist (never registered, or deleted); production is "
        "none: give --expect-production none",
    )
    assert "someone else" not in result.output and "production" not in aliases.current(client, model)
    aliases.promote(client, model, v, None, "rm", "go", verify=False)
    fallback = aliases.current(client, model)["fallback"]
    approval.approve(client, model, fallback, "rm", "the 16-bit build")
    result = _invoke("promote", model, fallback, "--expect-production", "5", "--by", "rm", "--reason", "r")
    assert f"production is v{v}: give --expect-production {v}" in result.output, result.output
    with pytest.raises(aliases.AliasConflict, match="someone else changed it first"):  # an existing one: a conflict
        aliases.promote(client, model, v, fallback, "rm", "r", verify=False)


def test_a_refused_rollback_suggests_only_a_target_that_would_work(reg):
    """production = fallback = v1, previous = v2 revoked: rollback suggested `--to fallback`, which then failed
    with "fallback is v1, which already is production"."""
    client, model, out = reg({"int4": "PASS"})
    v = str(out["builds"]["int4"]["version"])
    base = aliases.current(client, model)["fallback"]
    for x in (v, base):
        approval.approve(client, model, x, "rm", "gate PASS")
    aliases.promote(client, model, v, None, "rm", "go", verify=False)
    aliases.promote(client, model, base, v, "rm", "back to 16-bit", verify=False)  # previous = v
    approval.revoke(client, model, v, "rm", "bad outputs")
    result = _invoke("rollback", model, "--by", "oncall", "--reason", "p99")
    _one_line_error(
        result,
        f"{model} v{v} (previous) has its approval revoked; go to another version: `quantgate promote {model} "
        "VERSION` with an approved one",
    )
    assert "--to fallback" not in result.output
    result = _invoke("rollback", model, "--to", "fallback", "--by", "oncall", "--reason", "p99")
    _one_line_error(result, f"fallback is v{base}, which already is production; no other rollback target either")
    approval.approve(client, model, v, "rm", "fixed upstream")  # previous would work now: it is suggested
    result = _invoke("rollback", model, "--to", "fallback", "--by", "oncall", "--reason", "p99")
    _one_line_error(result, f"which already is production; `--to previous` goes to v{v}")


def _production_warning(result, version: str) -> str:
    lines = [x for x in result.output.splitlines() if x.startswith(f"warning: v{version} is still 'production'")]
    assert result.exit_code == 0 and len(lines) == 1, result.output
    return lines[0]


def test_revoking_production_advises_only_what_would_move_it(reg):
    """Revoking a version that was production and fallback advised `quantgate rollback`, which then failed with "no
    other rollback target"; the advice is the rollback that works, else a promote."""
    client, model, out = reg({"int4": "PASS", "fp8": "PASS"})
    v4, v8 = (str(out["builds"][b]["version"]) for b in ("int4", "fp8"))
    base = aliases.current(client, model)["fallback"]
    for v in (base, v4, v8):
        approval.approve(client, model, v, "rm", "gate PASS")
    aliases.promote(client, model, base, None, "rm", "16-bit first", verify=False)  # production = fallback, no previous
    warning = _production_warning(_invoke("revoke", model, base, "--by", "rm", "--reason", "r"), base)
    assert warning == (
        f"warning: v{base} is still 'production'; no rollback would take it anywhere (previous and fallback are unset, "
        f"this version, or revoked); promote an approved version: `quantgate promote {model} VERSION "
        f"--expect-production {base} --reason ...`"
    )
    _one_line_error(_invoke("rollback", model, "--by", "rm", "--reason", "r"), "nothing to roll back to")
    result = _invoke("promote", model, v4, "--expect-production", base, "--by", "rm", "--reason", "r")
    assert result.exit_code == 0, result.output  # what it advised works
    aliases.promote(client, model, v8, v4, "rm", "go", verify=False)  # previous = v4
    warning = _production_warning(_invoke("revoke", model, v8, "--by", "rm", "--reason", "r"), v8)
    assert warning == f"warning: v{v8} is still 'production'; run `quantgate rollback {model} --reason ...` " + (
        "(to previous)"
    )
    approval.revoke(client, model, v4, "rm", "bad too")  # previous revoked; the fallback v1 stays revoked too
    assert aliases.rollback_targets(client, model) == []
    approval.approve(client, model, base, "rm", "the 16-bit build is fine")
    warning = _production_warning(_invoke("revoke", model, v8, "--by", "rm", "--reason", "again"), v8)
    assert warning.endswith(f"run `quantgate rollback {model} --to fallback --reason ...` (the 16-bit build)")
    result = _invoke("rollback", model, "--to", "fallback", "--by", "rm", "--reason", "r")
    assert result.exit_code == 0 and aliases.current(client, model)["production"] == base, result.output


def test_recommend_is_refused_on_the_baseline_and_worded_truly_without_a_gate_recommendation(reg):
    """--recommend on the 16-bit build wrote "recommended by alice's override: why (the gate said -: )" and status
    showed reco=override on the baseline; on a version with no recommendation it said "the gate said -: "."""
    client, model, out = reg({"int4": "PASS"})
    v, base = str(out["builds"]["int4"]["version"]), aliases.current(client, model)["fallback"]
    n_events = len(audit.history(client, model))
    result = _invoke("approve", model, base, "--by", "alice", "--reason", "r", "--recommend", "why")
    _one_line_error(result, f"{model} v{base}: --recommend refused: it is the 16-bit baseline (gate.verdict=BASELINE)")
    assert len(audit.history(client, model)) == n_events  # refused before the approval too
    assert approval.approval_of(client, model, base).state == "none"
    with pytest.raises(QuantgateError, match="it is the 16-bit baseline"):
        approval.override_recommendation(client, model, base, "alice", "why")
    assert approval.RECO_BY not in client.get_model_version(model, base).tags
    assert client.get_model_version(model, v).tags.get("recommended") is None  # the gate recorded none
    result = _invoke("approve", model, v, "--by", "alice", "--reason", "r", "--recommend", "why")
    assert result.exit_code == 0, result.output
    assert "recommended by alice's override: why (the gate recorded no recommendation)" in result.output
    assert "-: " not in result.output


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("approve", "", "1", "--reason", "r"), "'': must not be empty or blank"),
        (("approve", "smollm2/x", "1", "--reason", "r"), "'smollm2/x': MLflow refuses a model name with '/' or ':'"),
        (("revoke", "a:b", "1", "--reason", "r"), "'a:b': MLflow refuses a model name with '/' or ':'"),
        (("promote", "..", "1", "--expect-production", "none", "--reason", "r"), "reads as a relative path"),
        (("rollback", " ", "--reason", "r"), "must not be empty or blank"),
        (("history", "m.quantgate-lock"), "'m.quantgate-lock' is quantgate's registry lock, not a model"),
        (("status", "x/y"), "'x/y': MLflow refuses a model name with '/' or ':'"),
        (
            ("promote", "m" * 230, "1", "--expect-production", "none", "--reason", "r"),
            "230 characters; at most 222 for a model quantgate changes",
        ),
        (("canary", "render", "", "3", "--format", "gateway-api"), "'': must not be empty or blank"),
        (("canary", "run", "a:b", "2"), "'a:b': MLflow refuses a model name with '/' or ':'"),
        (("canary", "run", "m" * 230, "2"), "230 characters; at most 222 for a model quantgate changes"),
        (("serve", "a/b", "--port", "0"), "'a/b': MLflow refuses a model name with '/' or ':'"),
    ],
)
def test_a_bad_model_name_is_refused_up_front_naming_model(reg, args, said):
    """`approve "" 1` gave MLflow's "Missing value for required parameter 'name'"; `approve smollm2/x 1` named the
    internal lock `smollm2/x.quantgate-lock`; `canary render`, `canary run` and `serve` did not check MODEL at all
    (MLflow's traceback "Invalid model name 'a/b'")."""
    client, model, _ = reg({"int4": "PASS"})
    acting = args[0] in ("approve", "revoke", "promote", "rollback") or args[:2] == ("canary", "run")
    result = _invoke(*args, "--by", "alice") if acting else _invoke(*args)
    assert result.exit_code == 2, result.output  # click's usage error, as for any bad argument
    _one_line_error(result, "Invalid value for '", "MODEL", said)
    assert "quantgate-lock'" not in result.output or "registry lock" in result.output
    assert "Missing value" not in result.output


def test_a_version_of_a_model_not_registered_says_the_model_is_not_registered(reg):
    """`approve nosuch 1` said `nosuch v1 does not exist (never registered, or deleted)`, sending the user to look for
    a version of a model that is not in this registry at all (a misspelled name, another MLFLOW_TRACKING_URI)."""
    client, model, _ = reg({"int4": "PASS"})
    said = (
        f"Error: model 'nosuch' is not registered at {store.tracking_uri()}; check the name (params.yaml "
        "register.model_name) or MLFLOW_TRACKING_URI"
    )
    assert _invoke("status", "nosuch").output.splitlines() == [said]  # the wording followed
    for args in (
        ("approve", "nosuch", "1", "--by", "rm", "--reason", "r"),
        ("revoke", "nosuch", "1", "--by", "rm", "--reason", "r"),
    ):
        result = _invoke(*args)
        assert result.exit_code == 1 and result.output.splitlines() == [said], result.output
    result = _invoke("approve", model, "99", "--by", "rm", "--reason", "r")  # a registered model: the version
    assert result.output.splitlines() == [
        f"Error: {model} v99 does not exist (never registered, or deleted); see `quantgate status {model}`"
    ], result.output
    assert "nosuch" not in [m.name for m in client.search_registered_models()]  # nothing left behind (a lock)


@pytest.mark.parametrize("run_id", ["", "  "])
def test_an_empty_run_id_is_a_usage_error_before_the_registry(run_id, tmp_path, monkeypatch):
    """`quantgate register ""` (an unset shell variable) went to the registry and exited 1."""
    monkeypatch.chdir(tmp_path)  # no registry here: a refusal that reached it would say so instead
    result = CliRunner().invoke(cli, ["register", run_id, "--by", "rm", "--override", "o"])
    assert result.exit_code == 2 and result.output.splitlines()[-1] == (
        "Error: Invalid value for 'RUN_ID': it is empty; give the build's run id (`quantgate status` lists the "
        "unregistered ones)"
    ), result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("run_id", ["", "  "])
def test_an_empty_canary_run_id_is_a_usage_error_before_the_registry(run_id, tmp_path, monkeypatch):
    """`promote --canary-run-id ""` (an unset shell variable) went to the registry and exited 1, "canary run ''
    does not exist at this tracking URI", where a blank RUN_ID of register is a usage error."""
    monkeypatch.chdir(tmp_path)  # no registry here: a refusal that reached it would say so instead
    args = ["promote", "m", "2", "--expect-production", "none", "--by", "rm", "--reason", "r"]
    result = CliRunner().invoke(cli, [*args, "--canary-run-id", run_id])
    assert result.exit_code == 2 and result.output.splitlines()[-1] == (
        "Error: Invalid value for '--canary-run-id': it is empty; give the run id `quantgate canary run` printed for "
        "this version"
    ), result.output
    assert list(tmp_path.iterdir()) == []


def test_a_run_id_pasted_with_spaces_around_it_is_found(reg):
    """RUN_ID's blank check strips it, but the id itself was looked up with its spaces: 'run ' 649b... ' does not
    exist in this registry' for a run `quantgate status` lists."""
    client, model, out = reg({"int4": "FAIL"})
    run_id = out["unregistered"]["int4"]["run_id"]
    result = _invoke("register", f" {run_id}\t", "--by", "rm", "--override", "ship it")
    assert result.exit_code == 0, result.output
    assert any(mv.run_id == run_id for mv in client.search_model_versions(f"name='{model}'"))


def test_a_long_model_name_mlflow_accepts_can_be_read(reg):
    """`status`, `history` and `canary render` take no lock: a 230-character model MLflow registered was refused as
    one it refuses."""
    client, _, _ = reg({"int4": "PASS"})
    long = "m" * 230
    client.create_registered_model(long)
    for args in (("status", long), ("history", long)):
        result = _invoke(*args)
        assert result.exit_code == 0 and "Invalid value" not in result.output, result.output
    Path("params.yaml").write_text("register: {}\ncanary:\n  steps: [5, 25, 50, 100]\n")
    result = _invoke("canary", "render", long, "1", "--format", "gateway-api")  # read, then refused for having no v1
    _one_line_error(result, f"{long} v1 does not exist")


def test_revoking_a_version_never_approved_says_it_records_a_veto(reg):
    """It said only "revoked by alice", as if an approval had been taken back."""
    client, model, out = reg({"int4": "PASS"})
    v = str(out["builds"]["int4"]["version"])
    result = _invoke("revoke", model, v, "--by", "alice", "--reason", "bad outputs")
    assert result.exit_code == 0, result.output
    assert f"{model} v{v}: was never approved (no `approval` tag); recorded a veto: revoked by alice" in result.output
    assert "until it is approved" in result.output
    result = _invoke("revoke", model, v, "--by", "bob", "--reason", "still bad")
    assert f"{model} v{v}: was already revoked; again: revoked by bob" in result.output, result.output
    approval.approve(client, model, v, "rm", "fixed")
    result = _invoke("revoke", model, v, "--by", "carol", "--reason", "p99")
    assert f"{model} v{v}: revoked by carol" in result.output and "recorded a veto" not in result.output


def test_report_of_a_missing_gate_json_elsewhere_does_not_send_to_dvc_repro(tmp_path, monkeypatch):
    """`report --gate-json /nonexistent.json` said "run `dvc repro` first": it writes results/gate.json only."""
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "nonexistent.json"
    result = _invoke("report", "--gate-json", str(missing))
    _one_line_error(
        result,
        f"--gate-json {missing} not found: run `dvc repro` first and drop --gate-json (it writes results/gate.json, "
        "the default, only), or give an existing gate JSON file",
    )
    _one_line_error(_invoke("report"), "results/gate.json not found: run `dvc repro` first")  # the default: it does
    default = tmp_path / "results" / "gate.json"  # the default spelt whole is the default
    result = _invoke("report", "--gate-json", str(default))
    _one_line_error(result, f"{default} not found: run `dvc repro` first")
    assert "drop --gate-json" not in result.output


def test_report_refuses_a_build_that_passes_with_a_team_failing(tmp_path, monkeypatch):
    """A gate.json with build int8 PASS and one team FAIL printed `int8: PASS`; the gate gives a build its worst
    team's verdict (pipeline/gate.py), so no gate wrote that file."""
    from quantgate.results import write_gate

    monkeypatch.chdir(tmp_path)
    result = gate_result({"int8": "PASS"})
    teams = dict(result.builds["int8"].teams)
    teams["billing"] = teams["search"].model_copy(update={"verdict": "FAIL"})
    bad = result.model_copy(update={"builds": {"int8": result.builds["int8"].model_copy(update={"teams": teams})}})
    write_gate(tmp_path / "bad.json", bad)
    out = _invoke("report", "--gate-json", str(tmp_path / "bad.json"))
    _one_line_error(out, "bad.json: build int8 is PASS but its team billing is FAIL; the gate gives a build its worst")
    assert "int8: PASS" not in out.output
    write_gate(tmp_path / "good.json", gate_result({"int8": "PASS", "int4": "FAIL"}))  # consistent: reported
    out = _invoke("report", "--gate-json", str(tmp_path / "good.json"))
    assert out.exit_code == 0 and "int8: PASS" in out.output and "int4: FAIL" in out.output, out.output


@pytest.mark.parametrize(
    "update, found",
    [
        ({"upper": 0.07}, "give INCONCLUSIVE"),  # over the 0.05 margin
        ({"upper": float("nan")}, "give no verdict (a bound or the margin is not a finite number)"),
        ({"margin": float("inf")}, "give no verdict (a bound or the margin is not a finite number)"),
    ],
)
def test_a_pass_its_own_bounds_do_not_give_is_refused_by_report_and_register(tmp_path, monkeypatch, update, found):
    """A gate.json whose team PASSes with a drop bound over the margin, or NaN (JSON's NaN reads as a float),
    printed `| +nan | ... | PASS |` and `int8: PASS`, and register would have made the build a model version."""
    from pipeline import register as register_stage
    from quantgate.results import write_gate

    monkeypatch.chdir(tmp_path)
    result = gate_result({"int8": "PASS"})
    teams = {t: c.model_copy(update=update) for t, c in result.builds["int8"].teams.items()}
    bad = result.model_copy(update={"builds": {"int8": result.builds["int8"].model_copy(update={"teams": teams})}})
    write_gate(tmp_path / "bad.json", bad)
    out = _invoke("report", "--gate-json", str(tmp_path / "bad.json"))
    _one_line_error(out, "bad.json: build int8, team search is PASS, but its drop bounds [")
    assert f"{found}; so this file is not the gate's: re-run `dvc repro gate`" in out.output
    assert "PASS |" not in out.output
    for name in ("report.md", "plot.png", "cost.png", "teams.json"):
        (tmp_path / name).write_text("x")
    args = ["models", "bad.json", "report.md", "plot.png", "cost.png", "teams.json", "eval", "out.json"]
    monkeypatch.setattr(sys, "argv", ["register", *args])
    monkeypatch.setattr(register_stage, "register", lambda *a: pytest.fail("registered"))
    with pytest.raises(QuantgateError, match=rf"bad.json: build int8, team search is PASS, .*{re.escape(found)}"):
        register_stage.main()
    assert not (tmp_path / "out.json").exists()


def test_an_interrupt_while_the_lock_is_taken_leaves_no_lock(reg, monkeypatch):
    """Ctrl-C landing after MLflow created the lock but before `held` could release it left the lock held until it
    was broken as stale (120 s): every alias change, rollback included, was refused meanwhile."""
    client, model, _ = reg({"int4": "PASS"})
    create = client.create_registered_model

    def created_then_interrupted(*args, **kwargs):
        create(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(client, "create_registered_model", created_then_interrupted)
    with pytest.raises(KeyboardInterrupt), lock.held(client, model, "candidate v1 by rm"):
        pass
    assert lock.holder_of(client, model) is None
    monkeypatch.setattr(client, "create_registered_model", create)
    with lock.held(client, model, "promote v1 by rm", wait_s=1):  # at once: nothing left behind
        assert lock.holder_of(client, model)["lock.holder"] == "promote v1 by rm"


def test_a_sqlite_registry_named_with_its_driver_keeps_its_artifacts_in_the_project(tmp_path, monkeypatch):
    """sqlite+pysqlite:/// is the same embedded store, but only "sqlite:" was read as local: its experiments got
    MLflow's default artifact root, relative to whichever folder a command ran in."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite+pysqlite:///{tmp_path / 'mlflow.db'}"
    client = store.client(uri)
    exp = client.get_experiment(store.experiment_id(client, "e", uri))
    assert exp.artifact_location == (tmp_path / "mlartifacts").as_uri()
