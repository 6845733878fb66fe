"""Check that a model version's artifacts are still the weights that were registered.

The reference is the version's tags (in the registry database), not anything inside the
artifact store: `weights_sha256.<file>` per weight file and `weights_sha256` over them all, and the serving
settings (`kv_cache_dtype`, `w4a8`) its build.json must still set.
The artifacts are the version's source, `<run artifact uri>/model`. A build run that is not a
version yet is checked the same way against its run tags before it is registered by override.
"""

from __future__ import annotations

import json
from pathlib import Path

from quantgate.errors import QuantgateError
from quantgate.hashing import digest_of, sha256_file
from quantgate.manifest import MANIFEST, SERVING_SETTINGS, serving_tags
from registry import versions

PREFIX = "weights_sha256."


def expected_weights(tags: dict[str, str], label: str) -> dict[str, str]:
    """{file: sha256} from a version's or build run's tags; raise QuantgateError if absent or inconsistent."""
    expected = {k[len(PREFIX) :]: v for k, v in tags.items() if k.startswith(PREFIX)}
    if not expected:
        raise QuantgateError(
            f"{label}: no {PREFIX}<file> tags; it was not registered by quantgate and cannot be verified"
        )
    if digest_of(expected) != tags.get("weights_sha256"):
        raise QuantgateError(
            f"{label}: the {PREFIX}<file> tags do not add up to tag weights_sha256; "
            f"the tags were edited after registration"
        )
    return expected


def verify_version(mlflow_client, model_name: str, version, dest_dir: Path) -> Path:
    """Download `version`'s model artifacts into `dest_dir` (empty or missing) and check them.

    Returns the local model directory (dest_dir/model). Raises QuantgateError naming the
    file when a weight file's sha256 differs from its tag, a tagged file is missing, or an
    untagged weight file is present: such a version must not be served.
    """
    mv = versions.require_version(mlflow_client, model_name, version)
    label = f"{model_name} v{mv.version}"
    expected = expected_weights(mv.tags, label)
    if not mv.run_id:
        raise QuantgateError(f"{label}: has no run; quantgate versions are created from a build run")
    run = mlflow_client.get_run(mv.run_id)
    if mv.source.rstrip("/") != f"{run.info.artifact_uri}/model":
        raise QuantgateError(
            f"{label}: source {mv.source} is not its run's `model` artifacts "
            f"({run.info.artifact_uri}/model); refusing to serve it"
        )
    local = check_artifacts(mlflow_client, mv.run_id, expected, label, dest_dir)
    check_serving_settings(mv.tags, local, label)
    return local


def check_serving_settings(tags: dict[str, str], local: Path, label: str, action: str = "serve") -> None:
    """Raise QuantgateError unless the downloaded build.json in `local` still sets the serving settings the
    version's tags recorded at registration (quantgate.manifest.serving_tags: w4a8, kv_cache_dtype): every
    server reads them from build.json, so one edited or lost after the gate would serve the weights as something
    else than what was gated (a W4A8 build as W4A16). A w4a8 the tags do not record is refused too (every W4A8
    build is tagged so); a kv_cache_dtype they do not record is not: versions registered before that tag was
    written were served with their build.json's, and still are. No build.json and no setting tagged: served
    with vLLM's defaults, as before."""
    tagged = {k: tags[k] for k in SERVING_SETTINGS if k in tags}
    try:
        manifest = json.loads((local / MANIFEST).read_text())
    except FileNotFoundError:
        manifest = {}
    except (OSError, ValueError):
        manifest = None
    if not isinstance(manifest, dict):
        raise QuantgateError(f"{label}: model/{MANIFEST} is unreadable or not a JSON object; refusing to {action} it")
    found = serving_tags(manifest)
    if any(found.get(k) != v for k, v in tagged.items()) or ("w4a8" in found and "w4a8" not in tagged):
        raise QuantgateError(
            f"{label}: model/{MANIFEST} sets {found or 'no serving setting'} but the tags recorded {tagged or 'none'} "
            f"when it was gated, so it would be served otherwise than it was gated; refusing to {action} it "
            "(serve another version, or register the build again with `dvc repro`)"
        )


def verify_run(mlflow_client, run, dest_dir: Path) -> Path:
    """Download build run `run`'s `model` artifacts into `dest_dir` and check them against the
    run's own weight tags, as `verify_version` does for a version (same errors)."""
    label = f"run {run.info.run_id}"
    expected = expected_weights(run.data.tags, label)
    local = check_artifacts(mlflow_client, run.info.run_id, expected, label, dest_dir, action="register")
    check_serving_settings(run.data.tags, local, label, action="register")
    return local


def check_artifacts(
    mlflow_client, run_id: str, expected: dict[str, str], label: str, dest_dir: Path, action: str = "serve"
) -> Path:
    """Download run `run_id`'s `model` artifacts into `dest_dir` (empty or missing) and compare every
    *.safetensors file with `expected` ({file: sha256}); return the local model directory. `action`
    (serve, register) is what a mismatch refuses."""
    from mlflow.exceptions import MlflowException

    source = f"{mlflow_client.get_run(run_id).info.artifact_uri}/model"
    dest_dir = Path(dest_dir)
    if dest_dir.exists() and any(dest_dir.iterdir()):
        raise QuantgateError(f"{dest_dir}: not empty; verify into an empty directory")
    dest_dir.mkdir(parents=True, exist_ok=True)
    try:
        local = Path(mlflow_client.download_artifacts(run_id, "model", str(dest_dir)))
    except (MlflowException, OSError) as exc:
        raise QuantgateError(f"{label}: cannot download its artifacts from {source}: {exc}") from None
    actual = {p.name: sha256_file(p) for p in sorted(local.glob("*.safetensors"))} if local.is_dir() else {}
    for name, digest in sorted(expected.items()):
        if name not in actual:
            raise QuantgateError(
                f"{label}: model/{name} is missing from the artifact store ({source}); refusing to {action} it"
            )
        if actual[name] != digest:
            raise QuantgateError(
                f"{label}: model/{name} in the artifact store has sha256 {actual[name][:16]}..., "
                f"but tag {PREFIX}{name} says {digest[:16]}...; the weights changed after they "
                f"were logged; refusing to {action} it"
            )
    extra = sorted(set(actual) - set(expected))
    if extra:
        raise QuantgateError(
            f"{label}: weight files in the artifact store that were not registered: "
            f"{', '.join('model/' + n for n in extra)}; refusing to {action} it"
        )
    return local
