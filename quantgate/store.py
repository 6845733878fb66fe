"""Builds by content address in a store every node can read (issue 31, item 3).

evaluate runs before register and `dvc repro` pushes nothing, so a stage that scores a build on other
machines first publishes it here, and a node fetches it by address and checks it before a server reads it.
The address is the build's identity as the evaluation cache keys it: the weights digest (build.json's one
digest over every weight file's sha256, the registry's weights_sha256 tag) and the digest of its other
files (config, tokenizer, chat template: quantgate.manifest.config_digest), so two builds with the same
weights and another chat template never share a folder.

    <store>/builds/<weights_digest>/<config_digest>/{*.safetensors, config.json, ..., build.json}
    <store>/builds/<weights_digest>/<config_digest>.complete     (written last: a half upload is not a build)

Any fsspec URL is a store (s3:// through s3fs with the usual AWS_* settings, file:// or a path on a
shared filesystem); executor.store, or the project's default DVC remote when it is not set.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from quantgate.errors import QuantgateError
from quantgate.manifest import config_digest, verify_weights

PREFIX = "builds"


def address(weights_digest: str, files_digest: str) -> str:
    """The build's path under a store: builds/<weights_digest>/<config_digest> (both 64 hex)."""
    return f"{PREFIX}/{weights_digest}/{files_digest}"


def _fs(store: str):
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(store, skip_instance_cache=True)  # credentials as they are now
    except (ImportError, ValueError) as exc:
        raise QuantgateError(f"executor.store {store!r}: not a store URL fsspec can open ({exc})") from None
    return fs, root.rstrip("/")


def default_store(repo: Path = Path(".")) -> str:
    """The URL of the project's default DVC remote (`dvc remote add -d`), the store when executor.store is
    unset. Raises QuantgateError when there is none."""
    from dvc.repo import Repo

    try:
        with Repo(str(repo)) as dvc:
            config = dvc.config
            name = config["core"].get("remote")
            if name:
                return config["remote"][name]["url"]
    except Exception as exc:  # not a DVC project, unreadable config
        raise QuantgateError(f"executor.store: unset and no DVC remote to use ({type(exc).__name__}: {exc})") from None
    raise QuantgateError(
        "executor.store: unset and the project has no default DVC remote; set executor.store to a URL every "
        "node can read (s3://bucket/prefix, or a shared path) or add one with `dvc remote add -d NAME URL`"
    )


def publish(model_dir: Path, store: str) -> str:
    """Upload the build in `model_dir` to `store` by content address unless it is there; return the address.

    Raises QuantgateError if the build's weights do not match its build.json (nothing is uploaded) or the
    store refuses a write (naming the store and the error).
    """
    manifest = verify_weights(model_dir)
    where = address(manifest["weights_digest"], config_digest(model_dir))
    fs, root = _fs(store)
    try:
        if fs.exists(f"{root}/{where}.complete"):
            return where
        fs.makedirs(f"{root}/{where}", exist_ok=True)  # a path store needs its folders; S3 has none to make
        for path in sorted(p for p in model_dir.iterdir() if p.is_file()):
            fs.put_file(str(path), f"{root}/{where}/{path.name}")
        fs.pipe_file(f"{root}/{where}.complete", manifest["weights_digest"].encode())
    except OSError as exc:
        raise QuantgateError(
            f"executor.store {store}: cannot upload {model_dir} ({type(exc).__name__}: {exc})"
        ) from None
    return where


def fetch(store: str, where: str, cache: Path) -> Path:
    """The build at `where` in `store`, downloaded once into `cache` (a node's own disk) and checked.

    A cached copy is re-checked before use. Raises QuantgateError (naming the address) if the store does
    not hold a complete build there, or the downloaded weights or files do not match the address.
    """
    weights_digest, files_digest = where.split("/")[-2:]
    local = cache / weights_digest / files_digest
    if local.is_dir():
        try:
            return _checked(local, weights_digest, files_digest)
        except QuantgateError:
            shutil.rmtree(local, ignore_errors=True)  # a damaged copy is fetched again
    fs, root = _fs(store)
    if not fs.exists(f"{root}/{where}.complete"):
        raise QuantgateError(f"{store}/{where}: no complete build there (its .complete marker is missing)")
    cache.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(prefix=".fetch-", dir=cache))
    try:
        for remote in fs.ls(f"{root}/{where}", detail=False):
            fs.get_file(remote, str(part / Path(remote).name))
        _checked(part, weights_digest, files_digest)
        local.parent.mkdir(parents=True, exist_ok=True)
        part.rename(local)  # the only step that makes it visible: a half download never is
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return local


def _checked(folder: Path, weights_digest: str, files_digest: str) -> Path:
    manifest = verify_weights(folder)
    if manifest["weights_digest"] != weights_digest or config_digest(folder) != files_digest:
        raise QuantgateError(f"{folder}: its weights or files do not match the address {weights_digest[:12]}")
    return folder
