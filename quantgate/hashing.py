"""Content digests: sha256 of files, and one digest over a set of named digests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from quantgate.errors import QuantgateError

CHUNK = 1 << 20  # 1 MiB reads keep memory flat on multi-GB weight files


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes. Raises QuantgateError naming the file when it cannot be read (its
    permissions, a folder, gone), not an OSError traceback."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise QuantgateError(f"{path}: cannot read it ({why}); check that it is a file you can read") from None
    return h.hexdigest()


def digest_of(named: dict[str, str]) -> str:
    """One hex sha256 over a {name: digest} map, independent of insertion order."""
    return hashlib.sha256("".join(f"{k}:{named[k]}\n" for k in sorted(named)).encode()).hexdigest()


def digest_json(obj: object) -> str:
    """Hex sha256 of a JSON-serialisable object in canonical form (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def digest_tree(root: Path) -> str:
    """One digest over every file below `root` (relative path + content)."""
    files = {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}
    return digest_of(files)
