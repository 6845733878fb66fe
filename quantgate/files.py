"""Files written whole: a reader sees the old file or the new one, never half of one; what a path that is
neither a file nor a folder is, or a symlink leads to; why a path is not a file to read (not_to_open, not_a_file)."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from quantgate.errors import QuantgateError


def special_kind(path: Path) -> str:
    """What `path`, which exists and is neither a regular file nor a folder, is: a FIFO, socket or device."""
    mode = path.stat().st_mode
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    return "a socket" if stat.S_ISSOCK(mode) else "a device"


def linked(path: Path, kind: str) -> str:
    """`kind` ("a file", special_kind's), what `path` is or leads to, said of `path`: as given, or for a symlink
    "a symlink to <kind> at <its target>" (the target as the link holds it, as dangling names it)."""
    return f"a symlink to {kind} at {path.readlink()}" if path.is_symlink() else kind


def dangling(link: Path) -> str:
    """What the symlink `link`, which leads to nothing, is: broken (its target, or a folder on the way to it, does
    not exist or is a file), a loop (ELOOP), or one whose target cannot be reached (e.g. a folder without search
    permission)."""
    try:
        link.resolve(strict=True)
    except (FileNotFoundError, NotADirectoryError):
        return f"a broken symlink: its target {link.readlink()} does not exist"
    except RuntimeError:  # Python before 3.13 raises RuntimeError("Symlink loop ...")
        pass
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            return f"a symlink whose target {link.readlink()} cannot be reached ({exc.strerror or exc})"
    return f"a symlink loop: its target {link.readlink()} leads back to it"


def not_to_open(path: Path) -> tuple[str, str] | None:
    """(what `path` is, the start of what to do) when a reader must not open it, else None (a regular file, a
    folder, or nothing there: the caller names what it wanted). A symlink to nothing is said in dangling's words,
    "fix the link or " first; a FIFO, socket or device is refused unread (reading a FIFO nobody writes waits
    forever), said with linked's words, so a symlink to one names its target. The caller ends the advice with
    the file it wants, e.g. `f"{path} is {what}; {fix}give the file itself"`. A path that cannot be looked up (a
    name too long, a folder on the way this user cannot search) is said with the system's words."""
    try:
        if path.is_symlink() and not path.exists():
            return dangling(path), "fix the link or "
        if path.exists() and not path.is_file() and not path.is_dir():
            return f"{linked(path, special_kind(path))}, not a regular file", ""
    except OSError as exc:  # ENAMETOOLONG, EACCES: pathlib's exists() raises them (a traceback)
        return f"a path that cannot be looked up ({exc.strerror or type(exc).__name__})", ""
    return None


def not_a_file(path: Path) -> tuple[str, str] | None:
    """(what `path` is, the start of what to do), in not_to_open's form, when a reader that needs a file cannot
    read one there: not_to_open's cases (a symlink to nothing, a FIFO, socket or device), a folder (a symlink to
    one named with its target, linked's words) or nothing there (a relative path: the working directory named);
    None for a regular file or a symlink to one. The caller ends the advice with the file it wants."""
    if (bad := not_to_open(path)) is not None:
        return bad
    if path.is_dir():
        return f"{linked(path, 'a folder')}, not a file", ""
    if not path.exists():
        return f"missing (no such file{'' if path.is_absolute() else f' in {Path.cwd()}'})", ""
    return None


def _umask() -> int:
    """This process's umask, read from /proc/self/status (Linux 4.7+): os.umask can only read it by setting it,
    which would change it for the threads beside this one for a moment. 0o022 where it cannot be read."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def write_whole(path: Path | str, text: str) -> None:
    """Write `text` (UTF-8) to `path` through a temporary file of its own in the same folder, renamed over
    `path` (rename is atomic within one file system, POSIX rename(2)): `path` is whole or untouched, and
    writers in parallel processes or threads each leave one whole file. An existing file keeps its permission
    bits (0o777: setuid and setgid are dropped, as a write clears them), a new one gets 0o666 less the umask
    (as open(2) would), and a symlink keeps its target. Not fsync'd: it guards readers, not power loss.

    Raises QuantgateError in one line, naming `path`, when its folder does not exist, it is a folder or
    anything but a regular file (a device, a FIFO: renaming over one would replace it), a symlink loop, or it
    or its folder cannot be read or written (permissions, a read-only file system, a name too long)."""
    path = Path(path)
    try:
        path = path.resolve(strict=False) if path.is_symlink() else path
        if path.is_symlink():  # Python 3.13+ resolves a loop without raising, to a link still
            raise RuntimeError("symlink loop")
        folder_ok, is_dir, exists = path.parent.is_dir(), path.is_dir(), path.exists()
        is_file = path.is_file()
    except RuntimeError:  # Python 3.11's resolve on a symlink loop
        raise QuantgateError(f"{path}: a symlink loop; give a file path") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise QuantgateError(f"{path}: a symlink loop; give a file path") from None
        raise QuantgateError(f"{path}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    if not folder_ok and path.parent.exists():  # said 'does not exist' of a file in the way
        raise QuantgateError(f"{path}: {path.parent} is a file, not a folder; give another path")
    if not folder_ok:
        raise QuantgateError(f"{path}: folder {path.parent} does not exist; create it or give another path")
    if is_dir:
        raise QuantgateError(f"{path}: is a folder; give a file path")
    if exists and not is_file:
        raise QuantgateError(f"{path}: not a regular file (a device, FIFO or socket); give a file path")
    mode = path.stat().st_mode & 0o777 if exists else 0o666 & ~_umask()
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
