"""Check that a model version's artifacts are still the weights that were registered.

The reference is the version's tags (in the registry database), not anything inside the
artifact store: `weights_sha256.<file>` per weight file and `weights_sha256` over them all.
The artifacts are the version's source, `<run artifact uri>/model`.
"""

from __future__ import annotations

from pathlib import Path

from quantgate.errors import QuantgateError
from quantgate.hashing import digest_of, sha256_file
from registry import versions

PREFIX = "weights_sha256."


def expected_weights(mv) -> dict[str, str]:
    """{file: sha256} from the version's tags; raise QuantgateError if absent or inconsistent."""
    expected = {k[len(PREFIX) :]: v for k, v in mv.tags.items() if k.startswith(PREFIX)}
    label = f"{mv.name} v{mv.version}"
    if not expected:
        raise QuantgateError(
            f"{label}: no {PREFIX}<file> tags; it was not registered by quantgate and cannot be verified"
        )
    if digest_of(expected) != mv.tags.get("weights_sha256"):
        raise QuantgateError(
            f"{label}: the {PREFIX}<file> tags do not add up to tag weights_sha256; "
            f"the version's tags were edited after registration"
        )
    return expected


def verify_version(mlflow_client, model_name: str, version, dest_dir: Path) -> Path:
    """Download `version`'s model artifacts into `dest_dir` (empty or missing) and check them.

    Returns the local model directory (dest_dir/model). Raises QuantgateError naming the
    file when a weight file's sha256 differs from its tag, a tagged file is missing, or an
    untagged weight file is present: such a version must not be served.
    """
    from mlflow.exceptions import MlflowException

    mv = versions.require_version(mlflow_client, model_name, version)
    label = f"{model_name} v{mv.version}"
    expected = expected_weights(mv)
    if not mv.run_id:
        raise QuantgateError(f"{label}: has no run; quantgate versions are created from a build run")
    run = mlflow_client.get_run(mv.run_id)
    if mv.source.rstrip("/") != f"{run.info.artifact_uri}/model":
        raise QuantgateError(
            f"{label}: source {mv.source} is not its run's `model` artifacts "
            f"({run.info.artifact_uri}/model); refusing to serve it"
        )
    dest_dir = Path(dest_dir)
    if dest_dir.exists() and any(dest_dir.iterdir()):
        raise QuantgateError(f"{dest_dir}: not empty; verify into an empty directory")
    dest_dir.mkdir(parents=True, exist_ok=True)
    try:
        local = Path(mlflow_client.download_artifacts(mv.run_id, "model", str(dest_dir)))
    except (MlflowException, OSError) as exc:
        raise QuantgateError(f"{label}: cannot download its artifacts from {mv.source}: {exc}") from None
    actual = {p.name: sha256_file(p) for p in sorted(local.glob("*.safetensors"))} if local.is_dir() else {}
    for name, digest in sorted(expected.items()):
        if name not in actual:
            raise QuantgateError(
                f"{label}: model/{name} is missing from the artifact store ({mv.source}); refusing to serve it"
            )
        if actual[name] != digest:
            raise QuantgateError(
                f"{label}: model/{name} in the artifact store has sha256 {actual[name][:16]}..., "
                f"but tag {PREFIX}{name} says {digest[:16]}...; the weights changed after "
                f"registration; refusing to serve it"
            )
    extra = sorted(set(actual) - set(expected))
    if extra:
        raise QuantgateError(
            f"{label}: weight files in the artifact store that were not registered: "
            f"{', '.join('model/' + n for n in extra)}; refusing to serve it"
        )
    return local
