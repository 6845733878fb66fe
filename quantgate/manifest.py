"""The build manifest: `build.json` inside every build directory (models/<build>/).

It records what the build is (build name, scheme, dtype), what it came from (base model id
and sha256), the sha256 of every weight file and one digest over them. The evaluate cache,
the gate report and the registry tags all read their identity from here.
"""

from __future__ import annotations

import json
from pathlib import Path

from quantgate.errors import QuantgateError
from quantgate.hashing import digest_of, sha256_file

MANIFEST = "build.json"


def weight_digests(model_dir: Path) -> dict[str, str]:
    """{file name: sha256} of every *.safetensors file in `model_dir`.

    Raises QuantgateError when there is none (not a safetensors checkpoint).
    """
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise QuantgateError(f"{model_dir}: no *.safetensors weight files")
    return {p.name: sha256_file(p) for p in files}


# build.json fields that say how every vLLM server of the build runs it (quantize.<build>: vLLM's
# --kv-cache-dtype; w4a8: VLLM_CPU_INT4_W4A8=1), recorded only where set
SERVING_SETTINGS = ("kv_cache_dtype", "w4a8")
SERVING_DEFAULTS = {"kv_cache_dtype": "auto", "w4a8": "false"}  # vLLM's, as serving_tags writes values


def serving_tags(manifest: dict) -> dict[str, str]:
    """{field: value as a registry tag} of the SERVING_SETTINGS a build.json content sets to other than vLLM's
    default (w4a8 false, kv_cache_dtype auto and a missing field are the default, so they are left out):
    {"w4a8": "true"}, {"kv_cache_dtype": "fp8"}. The registry tags these, and verifies them on download."""
    tags = {k: str(manifest[k]).lower() for k in SERVING_SETTINGS if manifest.get(k) is not None}
    return {k: v for k, v in tags.items() if v != SERVING_DEFAULTS[k]}


def serving_settings(model_dir: Path) -> dict[str, str]:
    """serving_tags of model_dir/build.json; {} where it sets none or cannot be read."""
    try:
        manifest = json.loads((model_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return serving_tags(manifest) if isinstance(manifest, dict) else {}


def config_digest(model_dir: Path) -> str:
    """One sha256 over every file of `model_dir` besides the weights and build.json (config,
    generation config, tokenizer, chat template, recipe) and the build's serving settings
    (serving_settings): they change what a server computes from the same weights, so the evaluation
    and profile caches and the store's address (quantgate/store.py) key on them too. Two builds with one
    set of weights and no setting (int4 and int4-mixed when its search keeps no layer) get one digest; int4
    and int4 served as W4A8 two. A build without settings gets the digest of its files alone, as before."""
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and p.suffix != ".safetensors" and p.name != MANIFEST)
    digests = {p.name: sha256_file(p) for p in files}
    if settings := serving_settings(model_dir):
        return digest_of({**digests, MANIFEST: digest_of(settings)})
    return digest_of(digests)


def write_manifest(model_dir: Path, *, build: str, scheme: str, dtype: str, base_model: dict, recipe: dict) -> dict:
    """Hash the weights in `model_dir` and write `model_dir/build.json`; return its content."""
    weights = weight_digests(model_dir)
    manifest = {
        "build": build,
        "scheme": scheme,
        "dtype": dtype,
        "base_model": base_model,
        "recipe": recipe,
        "weights": weights,
        "weights_digest": digest_of(weights),
    }
    (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(model_dir: Path) -> dict:
    """Read `model_dir/build.json`; raise QuantgateError if missing or unreadable."""
    path = model_dir / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise QuantgateError(f"{path}: missing; the build was not made by `dvc repro` (run it)") from None
    except json.JSONDecodeError as exc:
        raise QuantgateError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg}); re-run `dvc repro`") from None


def verify_weights(model_dir: Path) -> dict:
    """Re-hash the weights and compare with the manifest; return the manifest.

    Raises QuantgateError naming the first file whose sha256 differs or that is missing.
    """
    manifest = read_manifest(model_dir)
    actual = weight_digests(model_dir)
    for name, expected in manifest["weights"].items():
        if actual.get(name) != expected:
            raise QuantgateError(
                f"{model_dir / name}: sha256 does not match {MANIFEST}; the weights changed after the build"
            )
    if set(actual) != set(manifest["weights"]):
        extra = sorted(set(actual) - set(manifest["weights"]))
        raise QuantgateError(f"{model_dir}: weight files not in {MANIFEST}: {extra}")
    return manifest
