"""Scratch folders in the system temp folder that a SIGKILLed owner cannot leave behind for ever.

A Ray task or a vLLM server's stage removes its scratch folder on every exit path it lives through; a
SIGKILL (a Ray node that dies, the OOM killer) is the one it does not. Each folder is named with its
owner's process id, `<prefix><pid>-<random>`, and the next `scratch_dir` call with the same prefix removes
the folders whose owner is gone, so at most one run's worth is ever left.
"""

import os
import re
import shutil
import tempfile
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether process `pid` exists (a zombie counts: its folder may still be in use by its children)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: not ours to judge
        return True
    return True


def sweep(prefix: str, root: Path | None = None) -> list[Path]:
    """Remove `<root>/<prefix><pid>-*` folders whose process `pid` is gone; return those removed.
    `root` defaults to the system temp folder (TMPDIR)."""
    root = Path(root or tempfile.gettempdir())
    owned = re.compile(rf"{re.escape(prefix)}(\d+)-")
    removed = []
    for path in root.glob(f"{prefix}*-*"):
        if (m := owned.match(path.name)) and path.is_dir() and not alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def scratch_dir(prefix: str, root: Path | None = None) -> Path:
    """A new empty folder `<root>/<prefix><this pid>-<random>` (mode 0700), after sweeping the dead
    owners' folders of the same prefix. The caller removes it when done."""
    sweep(prefix, root)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root))
