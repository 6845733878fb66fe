"""Where the registry lives and how to reach it; no global MLflow state is set here.

Default: an embedded sqlite database `mlflow.db` and a local artifact store `mlartifacts/`
in the working directory. `MLFLOW_TRACKING_URI` overrides it (e.g. http://host:5000 for an
`mlflow server` backed by PostgreSQL and S3-compatible storage).
"""
from __future__ import annotations

import os
from pathlib import Path

DEFAULT_URI = "sqlite:///mlflow.db"
DEFAULT_ARTIFACTS = Path("mlartifacts")


def tracking_uri() -> str:
    """The tracking/registry URI: $MLFLOW_TRACKING_URI or the embedded sqlite default."""
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


def client(uri: str | None = None):
    """An MlflowClient for `uri` (default: `tracking_uri()`), used for tracking and registry."""
    from mlflow import MlflowClient

    uri = uri or tracking_uri()
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def experiment_id(mlflow_client, name: str) -> str:
    """Id of experiment `name`, created if missing.

    With the embedded sqlite store its artifacts go to ./mlartifacts (absolute file URI),
    so runs are readable from any working directory; a server decides its own root.
    """
    exp = mlflow_client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = DEFAULT_ARTIFACTS.resolve().as_uri() if tracking_uri_is_local(mlflow_client) else None
    return mlflow_client.create_experiment(name, artifact_location=location)


def tracking_uri_is_local(mlflow_client) -> bool:
    return str(mlflow_client._tracking_client.tracking_uri).startswith(("sqlite:", "file:", "/"))
