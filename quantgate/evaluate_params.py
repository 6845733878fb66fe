"""params.yaml's `evaluate` block (the vLLM servers, the lm-eval harness, remote endpoints), read by the evaluate
stage and checked by validate before any stage runs."""

from __future__ import annotations

from pathlib import Path

from quantgate.errors import QuantgateError
from quantgate.params import PARAMS_FILE, Frozen, where
from quantgate.scoring import HarnessParams
from quantgate.serving import Endpoint, ServeParams


class EvaluateParams(Frozen):
    """params.yaml block `evaluate`."""

    serve: ServeParams = ServeParams()
    harness: HarnessParams = HarnessParams()
    endpoints: dict[str, Endpoint] = {}  # build -> a vLLM deployment elsewhere, scored instead of a local server


def check_endpoint_builds(params: EvaluateParams, builds: list[str], path: Path = PARAMS_FILE) -> None:
    """Raises QuantgateError (params.yaml line) for an evaluate.endpoints key that is not in `builds`:
    a typo would silently score that build on a local server instead."""
    for build in params.endpoints:
        if build not in builds:
            at = where(path, f"evaluate.endpoints.{build}")
            raise QuantgateError(
                f"{at}: evaluate.endpoints.{build}: not a build of this run (builds: {builds}); fix the name or drop it"
            )
