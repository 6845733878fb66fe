"""Files written whole: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from quantgate.errors import QuantgateError


def write_whole(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` through a temporary file of its own in the same folder, renamed over
    `path` (rename is atomic within one file system, POSIX rename(2)): `path` is whole or untouched, and
    writers in parallel processes or threads each leave one whole file. An existing file keeps its permissions
    (a new one gets 0o644), and a symlink its target.

    Raises QuantgateError when the folder does not exist or `path` is a folder."""
    path = path.resolve() if path.is_symlink() else path
    if not path.parent.is_dir():
        raise QuantgateError(f"{path}: folder {path.parent} does not exist; create it or give another path")
    if path.is_dir():
        raise QuantgateError(f"{path}: is a folder; give a file path")
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
