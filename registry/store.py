"""Where the registry lives and how to reach it; no global MLflow state is set here.

Default: an embedded sqlite database `mlflow.db` and a local artifact store `mlartifacts/`
in the working directory. `MLFLOW_TRACKING_URI` overrides it (e.g. http://host:5000 for an
`mlflow server` backed by PostgreSQL and S3-compatible storage).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from quantgate.errors import QuantgateError

DEFAULT_DB = Path("mlflow.db")
DEFAULT_ARTIFACTS = Path("mlartifacts")


def tracking_uri() -> str:
    """The tracking/registry URI: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db.

    The default is made absolute because MLflow caches one database engine per URI string
    in a process: a relative URI would keep pointing at the first working directory's file.
    """
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{DEFAULT_DB.resolve()}"


def reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Raise QuantgateError in seconds when no server answers at `uri`, or when it answers its
    health check with a server error (5xx: say a proxy with no healthy upstream), quoting that
    answer; MLflow's own client would retry with backoff for minutes before saying so.
    Other answers (200, or 401/404 from a proxy that guards /health) count as reachable."""
    import httpx

    try:
        r = httpx.get(f"{uri.rstrip('/')}/health", timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise QuantgateError(
            f"MLflow server at {uri} is not reachable ({type(exc).__name__}); start it or fix MLFLOW_TRACKING_URI"
        ) from None
    if r.status_code >= 500:
        said = " ".join(r.text.split())[:300] or r.reason_phrase
        raise QuantgateError(
            f"MLflow server at {uri} answered {r.status_code} ({said}); check the server (or the proxy in "
            f"front of it) and MLFLOW_TRACKING_URI"
        )


def database_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Raise QuantgateError in seconds when the PostgreSQL database of a `postgresql://` tracking URI
    does not answer or refuses the connection; MLflow's store would retry for minutes first."""
    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(uri)
    shown = url.render_as_string(hide_password=True)
    try:
        psycopg.connect(
            url.set(drivername="postgresql").render_as_string(hide_password=False), connect_timeout=timeout_s
        ).close()
    except psycopg.Error as exc:
        why = " ".join(next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__).split())
        raise QuantgateError(
            f"database at {shown} is not reachable ({why}); start it or fix MLFLOW_TRACKING_URI"
        ) from None


CREDENTIAL_ERRORS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "InvalidClientTokenId",
}


def object_store_reachable(endpoint: str, timeout_s: float = 5.0) -> None:
    """Raise QuantgateError in seconds when the S3-compatible store at `endpoint` (MLFLOW_S3_ENDPOINT_URL)
    does not answer, or refuses the credentials in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY. One
    ListBuckets call, no retry; AccessDenied counts as reachable (a valid key without that permission)."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    config = Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 1, "mode": "standard"})
    try:
        # a new session: boto3's default one keeps the credentials it first read
        boto3.session.Session().client("s3", endpoint_url=endpoint, config=config).list_buckets()
    except NoCredentialsError:
        raise QuantgateError(
            f"no credentials for the object store at {endpoint}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        ) from None
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in CREDENTIAL_ERRORS:
            raise QuantgateError(
                f"the object store at {endpoint} refused the credentials ({code}); "
                "fix AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
            ) from None
    except BotoCoreError as exc:
        raise QuantgateError(
            f"object store at {endpoint} is not reachable ({type(exc).__name__}); "
            "start it or fix MLFLOW_S3_ENDPOINT_URL"
        ) from None


DATABASES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow's SQL stores; scheme as SQLAlchemy spells it
SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file


def uri_scheme(uri: str) -> str:
    """The scheme of tracking URI `uri` as MLflow picks its store (mlflow.tracking.registry): "databricks",
    "databricks-uc" and "uc" whole; else urllib's scheme, lower case, with SQLAlchemy's "+driver" cut off
    (postgresql+psycopg); "" for a path, a Windows drive letter's (C:/x) too: MLflow's file store."""
    from urllib.parse import urlparse

    if uri in ("databricks", "databricks-uc", "uc"):
        return uri
    try:
        scheme = urlparse(uri).scheme.split("+", 1)[0].lower()
    except ValueError:  # e.g. "http://[::1": the URL checks below name it
        scheme = uri.split(":", 1)[0].split("+", 1)[0].lower() if ":" in uri else ""
    return "" if len(scheme) == 1 else scheme


def check_settings(uri: str) -> None:
    """Raise QuantgateError, one line naming the variable and the fix, when the tracking URI `uri` or
    $MLFLOW_S3_ENDPOINT_URL cannot work however the servers behave: a blank URI, MLflow's file store (a path or
    file:// URI) unless $MLFLOW_ALLOW_FILE_STORE opts in as MLflow itself asks, a malformed http(s) URL, a
    database URL SQLAlchemy cannot parse, whose scheme is not in lower case (SQLITE://: MLflow reads http(s) in any
    case, SQLAlchemy not) or whose driver is not installed, a sqlite URL whose file cannot be checked as the one MLflow
    opens (sqlite_file: uri=true, %XX or ? in its folders, a sqlite+DRIVER path in a missing folder), a sqlite path
    that is a folder or a file that is no SQLite database. Checked before anything connects: MLflow, httpx and
    botocore failed on these with tracebacks (httpx.InvalidURL, ModuleNotFoundError, sqlalchemy's DatabaseError,
    ValueError)."""
    if not uri.strip():  # "" is unset (tracking_uri); "  " was called MLflow's file store
        raise QuantgateError(
            f"MLFLOW_TRACKING_URI {uri!r} is blank; unset it for the default registry ./mlflow.db, or give "
            "sqlite:///<path>/mlflow.db, postgresql://... or the MLflow server's http(s)://HOST:PORT"
        )
    scheme = uri_scheme(uri)
    if scheme in ("", "file") and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() not in ("true", "1"):
        # MLflow's FileStore raised MlflowException("... in maintenance mode") as a traceback
        raise QuantgateError(
            f"MLFLOW_TRACKING_URI {uri!r} is MLflow's file store, which its client refuses (in maintenance mode) "
            "unless MLFLOW_ALLOW_FILE_STORE=true; give sqlite:///<path>/mlflow.db, postgresql://... or the MLflow "
            "server's http(s)://HOST:PORT (`mlflow migrate-filestore` moves what the folder holds)"
        )
    if scheme in ("http", "https"):
        if (why := _http_problem(uri)) is not None:
            raise QuantgateError(
                f"MLFLOW_TRACKING_URI {uri!r} is not a usable URL ({why}); give the MLflow server's "
                "http(s)://HOST:PORT, e.g. http://127.0.0.1:5000"
            )
    elif scheme in DATABASES:
        _check_database(uri)
    endpoint = os.environ.get("MLFLOW_S3_ENDPOINT_URL")
    if endpoint and (why := _http_problem(endpoint)) is not None:
        raise QuantgateError(
            f"MLFLOW_S3_ENDPOINT_URL {endpoint!r} is not a usable URL ({why}); give the S3-compatible object "
            "store's http(s)://HOST:PORT, e.g. http://127.0.0.1:9000"
        )


def _http_problem(url: str) -> str | None:
    """Why `url` is no http(s) URL with a host and a port in 1-65535 (when it names one), or None."""
    import httpx

    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:  # e.g. "https://[::1": Invalid port: ':1'
        return str(exc) or type(exc).__name__
    if parsed.scheme not in ("http", "https"):
        return "not http:// or https://"
    if not parsed.host:
        return "no host"
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        return f"port {parsed.port} is not in 1-65535"
    return None


def _check_database(uri: str) -> None:
    """The database URL `uri` parses, its scheme is in lower case, its Python driver is installed, and a sqlite file is
    an SQLite database; else QuantgateError naming MLFLOW_TRACKING_URI."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        url = make_url(uri)
        if url.drivername != url.drivername.lower():  # SQLAlchemy loads "SQLITE" as a plugin: Can't load plugin
            raise QuantgateError(
                f"MLFLOW_TRACKING_URI {url.render_as_string(hide_password=True)}: SQLAlchemy (so MLflow's database "
                f"store) reads the scheme in lower case only; give "
                f"{url.set(drivername=url.drivername.lower()).render_as_string(hide_password=True)}"
            )
        dialect = url.get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:  # e.g. "postgresql://[::1", "mysql+junk://"
        raise QuantgateError(
            f"MLFLOW_TRACKING_URI is not a usable database URL ({' '.join(str(exc).split())}); give one such as "
            "sqlite:////abs/path/mlflow.db or postgresql://USER@HOST:PORT/DB"
        ) from None
    try:
        dialect.import_dbapi()  # the driver module: mysql:// needs MySQLdb, mssql:// pyodbc
    except ImportError as exc:
        raise QuantgateError(
            f"MLFLOW_TRACKING_URI {url.render_as_string(hide_password=True)}: its database driver "
            f"{exc.name or exc} is not installed here; install it, or use a sqlite:///, postgresql:// or "
            "http(s):// registry"
        ) from None
    if (path := sqlite_file(uri)) is not None:
        _check_sqlite_file(path)


def sqlite_file(uri: str) -> Path | None:
    """The database file SQLAlchemy's sqlite driver, so MLflow's database store, opens for tracking URI `uri`: an
    absolute Path, or None when `uri` is no sqlite URL or an in-memory database (sqlite://, sqlite:///:memory:).

    Read as SQLAlchemy reads it (the path it hands sqlite3.connect): the query string holds options, not part of the
    path (sqlite:////p/mlflow.db?timeout=30 is /p/mlflow.db), %XX escapes are decoded once (a%20b.db is "a b.db",
    a%3Fb.db "a?b.db"), a relative path is from the working folder. Every check of a sqlite registry file goes
    through this, so it looks at the file MLflow writes. Raises QuantgateError naming MLFLOW_TRACKING_URI when
    SQLAlchemy cannot read `uri` as a sqlite URL (a host in it, an option of the wrong type), or when it asks for
    SQLite's own URI filenames (uri=true): SQLite then reads the path by its own rules (file: URIs, ?mode=, %XX
    decoded a second time; a plain path gets the other options glued to its name) and MLflow makes folders named
    after the raw text, so no file can be checked for it. Refused too: %XX or ? in a folder of a sqlite:/// path,
    the default's working folder too (MLflow makes the folder of the text as written, say sp%20dir; SQLite then found
    no "sp dir" and MLflow retried for minutes; in a folder q?x the default registry was a file q beside it), and a
    sqlite+DRIVER:/// path whose folder is missing (MLflow makes the folder for sqlite:/// alone).
    """
    import warnings

    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        url = make_url(uri)
        if url.get_backend_name() != "sqlite":
            return None
        with warnings.catch_warnings():  # options pysqlite ignores (?mode=ro): SQLAlchemy warns when MLflow connects
            warnings.simplefilter("ignore")
            (filename, *_), options = url.get_dialect()().create_connect_args(url)
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:  # sqlite://host/x.db, ?timeout=soon
        raise QuantgateError(
            f"MLFLOW_TRACKING_URI is not a usable sqlite URL ({' '.join(str(exc).split())}); give "
            "sqlite:////abs/path/mlflow.db"
        ) from None
    if options.get("uri"):
        raise QuantgateError(
            f"MLFLOW_TRACKING_URI {uri}: SQLite URI filenames (uri=true) are not supported (SQLite reads the path by "
            "its own rules, so quantgate cannot check the file MLflow opens); give sqlite:////abs/path/mlflow.db, "
            "with ?timeout=SECONDS if wanted"
        )
    if filename == ":memory:":
        return None
    path = Path(filename)
    if not uri.startswith("sqlite:///"):  # sqlite+pysqlite:///: MLflow makes no folder
        if not path.parent.is_dir():
            raise QuantgateError(
                f"MLFLOW_TRACKING_URI {uri}: there is no folder {path.parent}, and MLflow makes one only for a "
                "sqlite:/// URI (SQLite could not open the file, and MLflow retried for minutes); create it, or give "
                f"sqlite:///{path}"
            )
    elif (made := Path(os.path.abspath(uri.removeprefix("sqlite:///"))).parent) != path.parent:
        # mlflow.store.db.utils._make_parent_dirs_if_sqlite: the URI's text, %XX kept
        query = uri.partition("?")[2]
        if not os.environ.get("MLFLOW_TRACKING_URI"):  # the default has no options: its ? is the working folder's
            named = f"the default registry {uri} (MLFLOW_TRACKING_URI is unset)"
            fix = "run from a folder whose path has no %XX or ?, or set MLFLOW_TRACKING_URI"
        elif "=" in query.split("/")[0] and "/" in query:  # options, not a folder q?x: MLflow's folder ended in them
            named, fix = f"MLFLOW_TRACKING_URI {uri}", "give the options after ? with no / in them"
        else:
            named, fix = f"MLFLOW_TRACKING_URI {uri}", "give a path with no %XX or ? in its folders"
        raise QuantgateError(
            f"{named}: MLflow makes the folder {made} (the URI's text as written) but SQLAlchemy opens {path} "
            f"(query cut off, %XX decoded); {fix}"
        )
    return path


def _check_sqlite_file(path: Path) -> None:
    """`path`, when there, is an SQLite database (an empty file is one too: sqlite starts it); else QuantgateError
    saying what it is and which setting to fix."""
    where = (
        "MLFLOW_TRACKING_URI"
        if os.environ.get("MLFLOW_TRACKING_URI")
        else f"the default registry {DEFAULT_DB} (MLFLOW_TRACKING_URI is unset)"
    )
    fix = "point MLFLOW_TRACKING_URI at the registry's mlflow.db (sqlite:////abs/path/mlflow.db)"
    if path.is_dir():
        raise QuantgateError(f"{where}: {path} is a folder, not an SQLite database; {fix}")
    try:
        with path.open("rb") as f:
            head = f.read(len(SQLITE_HEADER))
    except FileNotFoundError:
        return  # MLflow creates it (or client(existing=True) refuses it)
    except OSError as exc:
        raise QuantgateError(f"{where}: cannot read {path} ({exc.strerror or exc}); {fix}") from None
    if head and head != SQLITE_HEADER:
        raise QuantgateError(f"{where}: {path} is not an SQLite database (no SQLite header); {fix}")


def client(uri: str | None = None, existing: bool = False):
    """An MlflowClient for `uri` (default: `tracking_uri()`), used for tracking and registry.

    The settings must be usable (`check_settings`); then an http(s) URI must answer (`reachable`), a postgresql://
    database too (`database_reachable`), and the object store at $MLFLOW_S3_ENDPOINT_URL, with the credentials
    given (`object_store_reachable`). existing=True (commands that act on a registry `dvc repro` made): raises
    QuantgateError when the URI is a sqlite file that does not exist, or holds no registry (an empty file, another
    SQLite database), instead of MLflow creating an empty registry there (the usual cause: running from another
    folder than the project).
    """
    from mlflow import MlflowClient

    uri = uri or tracking_uri()
    check_settings(uri)
    scheme = uri_scheme(uri)  # HTTP://host went to MLflow unchecked, which retried for minutes
    if scheme in ("http", "https"):
        reachable(uri)
    if scheme == "postgresql":
        database_reachable(uri)
    if os.environ.get("MLFLOW_S3_ENDPOINT_URL"):  # artifacts in an S3-compatible store: check it answers
        object_store_reachable(os.environ["MLFLOW_S3_ENDPOINT_URL"])
    if existing and uri_scheme(uri) == "sqlite":  # the file SQLAlchemy opens, not the URI's text after sqlite:///
        if (path := sqlite_file(uri)) is None:
            raise QuantgateError(
                f"no registry in MLFLOW_TRACKING_URI {uri}: an in-memory database lasts one process, so no command "
                "finds what `dvc repro` registered; point it at the registry's mlflow.db (sqlite:////abs/path/mlflow.db)"
            )
        if not path.is_file():
            raise QuantgateError(
                f"no registry at {path}: run from the project folder after "
                "`dvc repro` (its register stage makes it), or set MLFLOW_TRACKING_URI"
            )
        if not _holds_registry(path):
            raise QuantgateError(
                f"no registry in {path}: it is an empty file or another SQLite database (MLflow would write its "
                "tables into it); point MLFLOW_TRACKING_URI at the registry's mlflow.db, or run `dvc repro` (its "
                "register stage makes it)"
            )
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _holds_registry(path: Path) -> bool:
    """Whether the SQLite file `path` has MLflow's model registry table, read without writing to it; True when it
    cannot be read here (MLflow then says why)."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=30)) as db:
            found = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'registered_models'")
            return found.fetchone() is not None
    except sqlite3.Error:
        return True


def experiment_id(mlflow_client, name: str, uri: str | None = None) -> str:
    """Id of experiment `name`, created if missing (by another process meanwhile too: two canaries started at
    once on a new registry both created it, and the slower one failed).

    With the embedded sqlite store its artifacts go to ./mlartifacts (absolute file URI),
    so runs are readable from any working directory; a server decides its own root.
    """
    from mlflow.exceptions import MlflowException

    exp = mlflow_client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    local = uri_scheme(uri or tracking_uri()) in ("sqlite", "file", "")  # sqlite+pysqlite:// too; "": a path
    location = DEFAULT_ARTIFACTS.resolve().as_uri() if local else None
    try:
        return mlflow_client.create_experiment(name, artifact_location=location)
    except MlflowException as exc:
        if (
            getattr(exc, "error_code", "") != "RESOURCE_ALREADY_EXISTS"
            or (exp := mlflow_client.get_experiment_by_name(name)) is None
        ):
            raise
        return exp.experiment_id
