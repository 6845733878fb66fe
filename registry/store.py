"""Where the registry lives and how to reach it; no global MLflow state is set here.

Default: an embedded sqlite database `mlflow.db` and a local artifact store `mlartifacts/`
in the working directory. `MLFLOW_TRACKING_URI` overrides it (e.g. http://host:5000 for an
`mlflow server` backed by PostgreSQL and S3-compatible storage).
"""

from __future__ import annotations

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


def client(uri: str | None = None, existing: bool = False):
    """An MlflowClient for `uri` (default: `tracking_uri()`), used for tracking and registry.

    An http(s) URI must answer first (`reachable`). existing=True (commands that act on a
    registry `dvc repro` made): raises QuantgateError when the URI is a sqlite file that does
    not exist, instead of MLflow creating an empty registry there (the usual cause: running
    from another folder than the project).
    """
    from mlflow import MlflowClient

    uri = uri or tracking_uri()
    if uri.startswith(("http://", "https://")):
        reachable(uri)
    if existing and uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise QuantgateError(
            f"no registry at {uri.removeprefix('sqlite:///')}: run from the project folder after "
            "`dvc repro` (its register stage makes it), or set MLFLOW_TRACKING_URI"
        )
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def experiment_id(mlflow_client, name: str, uri: str | None = None) -> str:
    """Id of experiment `name`, created if missing.

    With the embedded sqlite store its artifacts go to ./mlartifacts (absolute file URI),
    so runs are readable from any working directory; a server decides its own root.
    """
    exp = mlflow_client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    local = (uri or tracking_uri()).startswith(("sqlite:", "file:", "/"))
    location = DEFAULT_ARTIFACTS.resolve().as_uri() if local else None
    return mlflow_client.create_experiment(name, artifact_location=location)
