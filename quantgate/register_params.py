"""params.yaml's `register` block (the MLflow registered model and experiment), read by the register stage and
`quantgate status`, and checked by validate before any stage runs."""

from __future__ import annotations

from pydantic import Field

from quantgate.params import Frozen


class RegisterParams(Frozen):
    """params.yaml block `register`: the registered model's name and the experiment its runs go to (MLflow
    refuses an empty or blank name)."""

    model_name: str = Field(default="smollm2-135m-instruct", min_length=1, pattern=r"\S")
    experiment: str = Field(default="quantgate-builds", min_length=1, pattern=r"\S")
