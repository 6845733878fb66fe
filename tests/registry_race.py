"""Child-process side of the concurrent-promotion test (tests/test_registry_contract.py).

Imported once by a multiprocessing fork server (preload), so each racing process starts in
milliseconds instead of importing MLflow again; each still opens its own connection.
"""

import os

import mlflow.store.model_registry.sqlalchemy_store
import mlflow.store.tracking.sqlalchemy_store  # noqa: F401  with what a client of either store imports)
from mlflow import MlflowClient  # noqa: F401

from registry import aliases, store


def promote_at_barrier(uri: str, env: dict[str, str], model: str, version: str, barrier, results) -> None:
    """With `env` set (the object store's address and key), connect, wait for the other racer,
    promote `version` expecting no production; report."""
    os.environ.update(env)  # the fork server's environment predates the test's
    client = store.client(uri)
    client.get_registered_model(model)  # connection and store set up before the race
    barrier.wait(timeout=60)
    try:
        changes = aliases.promote(client, model, version, None, f"proc-{version}", "race")
        results.put({"version": version, "won": [str(c) for c in changes]})
    except aliases.AliasConflict as exc:
        results.put({"version": version, "conflict": str(exc)})
    except Exception as exc:  # reported to the test, which fails on it
        results.put({"version": version, "error": repr(exc)})
