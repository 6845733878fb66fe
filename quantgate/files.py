"""Files written whole: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from quantgate.errors import QuantgateError


def write_whole(path: Path | str, text: str) -> None:
    """Write `text` (UTF-8) to `path` through a temporary file of its own in the same folder, renamed over
    `path` (rename is atomic within one file system, POSIX rename(2)): `path` is whole or untouched, and
    writers in parallel processes or threads each leave one whole file. An existing file keeps its permission
    bits (a new one gets 0o644), and a symlink its target. Not fsync'd: it guards readers, not power loss.

    Raises QuantgateError in one line, naming `path`, when its folder does not exist, it is a folder or
    anything but a regular file (a device, a FIFO: renaming over one would replace it), or the folder cannot be
    written (its permissions, a read-only file system, a name too long)."""
    path = Path(path)
    try:
        path = path.resolve(strict=False) if path.is_symlink() else path
    except (OSError, RuntimeError):  # a symlink loop
        raise QuantgateError(f"{path}: a symlink that resolves to no file (a loop); give a file path") from None
    if not path.parent.is_dir():
        raise QuantgateError(f"{path}: folder {path.parent} does not exist; create it or give another path")
    if path.is_dir():
        raise QuantgateError(f"{path}: is a folder; give a file path")
    if path.exists() and not path.is_file():
        raise QuantgateError(f"{path}: not a regular file (a device, FIFO or socket); give a file path")
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:64]}.", suffix=".tmp")
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise QuantgateError(f"{path}: cannot write in {path.parent} ({why}); give a folder you can write") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise QuantgateError(f"{path}: cannot write it ({exc.strerror or type(exc).__name__})") from None
        raise
