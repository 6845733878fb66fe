"""params.yaml's `register` block (the MLflow registered model and experiment), read by the register stage and
`quantgate status`, and checked by validate before any stage runs."""

from __future__ import annotations

import posixpath

from pydantic import field_validator

from quantgate.params import Frozen

# MLflow's own limits (mlflow/utils/validation.py, 3.x: _validate_model_name, _validate_experiment_name); the
# register stage would otherwise meet them after every build is scored
MAX_EXPERIMENT_NAME = 500
# MLflow's SQL stores keep a registered model's name in String(256) (mlflow/store/model_registry/dbmodels), and the
# registry lock (registry/lock.py) is a model named <name>.quantgate-lock, renamed <that>.stale.<12 hex> when broken
MAX_MODEL_NAME = 256 - len(".quantgate-lock.stale.") - 12


def model_name_problem(value: str, locked: bool = True) -> str | None:
    """Why `value` cannot name a registered model, or None: MLflow's rules (not blank, no '/' or ':', not a
    relative path) and, where quantgate will lock the model to change it (`locked`), MAX_MODEL_NAME."""
    if not value.strip():
        return "must not be empty or blank: give the registered model's name"
    if "/" in value or ":" in value:
        return f"{value!r}: MLflow refuses a model name with '/' or ':'; use '-' instead"
    if locked and len(value) > MAX_MODEL_NAME:
        return (
            f"{len(value)} characters; at most {MAX_MODEL_NAME} for a model quantgate changes (MLflow's SQL stores "
            "keep 256, and quantgate's registry lock adds its suffix to the name)"
        )
    norm = posixpath.normpath(value)
    if norm != value or norm == "." or norm.startswith(".."):
        return f"{value!r}: MLflow refuses a model name that reads as a relative path; rename it"
    return None


class RegisterParams(Frozen):
    """params.yaml block `register`: the registered model's name and the experiment its runs go to, each a name
    MLflow accepts (raises ValueError, as pydantic's message, for one it refuses)."""

    model_name: str = "smollm2-135m-instruct"
    experiment: str = "quantgate-builds"

    @field_validator("model_name")
    @classmethod
    def _model_name(cls, value: str) -> str:
        if (problem := model_name_problem(value)) is not None:
            raise ValueError(problem)
        return value

    @field_validator("experiment")
    @classmethod
    def _experiment(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty or blank: give the MLflow experiment's name")
        if len(value) > MAX_EXPERIMENT_NAME:
            raise ValueError(f"{len(value)} characters; MLflow takes at most {MAX_EXPERIMENT_NAME}")
        return value
