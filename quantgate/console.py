"""Quiet stage output: the stage's own lines on the terminal, library output in a per-stage log file.

Every DVC stage runs under `quantgate.errors.run_main(main, log=NAME)`, which runs it inside
`stage_log(NAME)`: the log is `results/logs/NAME.log` (e.g. `quantize@int4.log`, rewritten each run;
results/ is not in git, and results/logs/ is no DVC output). Inside it:
- what project code prints (pipeline/, quantgate/, registry/, canary/, the stage's `__main__`) reaches
  the terminal as before;
- everything else goes to the log: Python logging (INFO and up), warnings, loguru (llm-compressor's
  per-module lines), library `print`s and progress bars, and whatever reaches file descriptors 1 and 2
  (C code, child processes);
- the stage's last line names the log; on an error the whole log is shown first, then the error.
The project's own progress bars (`progress`, `log_progress`) draw on the terminal's stderr, only on a TTY.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

LOG_DIR = Path("results/logs")
OWN = ("pipeline", "quantgate", "registry", "canary", "__main__")  # top-level modules whose prints are the stage's
QUIET_ENV = {  # read by libraries imported later and by child processes
    "TQDM_DISABLE": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",  # no "process just got forked" notice
}
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass
class _Stage:
    log: TextIO
    out: TextIO  # the terminal's stdout
    err: TextIO  # the terminal's stderr
    watchers: list[Callable[[str], None]] = field(default_factory=list)


_active: _Stage | None = None


class _Split(io.TextIOBase):
    """sys.stdout or sys.stderr inside a stage: writes by project code go to `terminal`, others to the log."""

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, terminal: TextIO, stage: _Stage):
        self.terminal, self.stage = terminal, stage
        self.buffer = stage.log.buffer

    def write(self, s: str) -> int:
        if self.stage.log.closed:  # a library writing after its stage ended
            return sys.__stderr__.write(s)
        try:
            caller = sys._getframe(1).f_globals.get("__name__", "")
        except ValueError:  # called from C with no Python frame
            caller = ""
        if caller.partition(".")[0] in OWN:
            return self.terminal.write(s)
        for watch in self.stage.watchers:
            watch(s)
        return self.stage.log.write(s)

    def flush(self) -> None:
        self.terminal.flush()
        self.stage.log.flush()

    def fileno(self) -> int:
        return self.stage.log.fileno()

    def isatty(self) -> bool:
        return False  # libraries asking get the log's answer: no colours, no bars

    def writable(self) -> bool:
        return True


def per_build(stage: str) -> str:
    """The log name of a foreach stage whose first argument is the build: `stage@BUILD` (DVC's name)."""
    if len(sys.argv) < 2:
        return stage
    return f"{stage}@{re.sub(r'[^A-Za-z0-9_.-]', '_', sys.argv[1])}"


def label(name: str) -> str:
    """How a stage names itself on the terminal: `quantize@int4` -> `quantize[int4]`."""
    stage, _, build = name.partition("@")
    return f"{stage}[{build}]" if build else stage


@contextlib.contextmanager
def stage_log(name: str, log_dir: Path = LOG_DIR, expected: tuple[type[BaseException], ...] = ()) -> Iterator[Path]:
    """Run the block with library output sent to `log_dir/NAME.log` (module docstring); yields its path.

    On success the last terminal line names the log. On an Exception the traceback is appended to the
    log (unless the exception is one of `expected`, whose message says it all) and the whole log is
    shown on the terminal's stderr, then the exception propagates. Ctrl-C and SystemExit only name the log.
    """
    global _active
    path = log_dir / f"{name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = (os.dup(1), os.dup(2))
    saved = (sys.stdout, sys.stderr, dict(os.environ), _active)
    log = open(path, "w", buffering=1, encoding="utf-8", errors="replace")
    stage = _Stage(
        log=log,
        out=open(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace"),
        err=open(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace"),
    )
    handler = logging.StreamHandler(log)
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root_level = root.level
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout, sys.stderr = _Split(stage.out, stage), _Split(stage.err, stage)
    os.environ.update(QUIET_ENV)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    _active = stage
    outcome = "ok"
    try:
        yield path
    except Exception as exc:
        outcome = "failed"
        if not isinstance(exc, expected):
            log.write("".join(traceback.format_exception(exc)))
        raise
    except BaseException:  # Ctrl-C, SIGTERM, sys.exit
        outcome = "stopped"
        raise
    finally:
        logging.captureWarnings(False)
        root.removeHandler(handler)
        root.setLevel(root_level)
        sys.stdout.flush()
        sys.stderr.flush()
        log.flush()
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)
        sys.stdout, sys.stderr, env, _active = saved
        os.environ.clear()
        os.environ.update(env)
        log.close()
        if outcome == "failed":
            show(path, stage.err)
        else:
            print(f"{label(name)}: log {path}", file=stage.out if outcome == "ok" else stage.err)
        stage.out.close()
        stage.err.close()


def show(path: Path, to: TextIO) -> None:
    """Write the log at `path` whole to `to`, between two lines that name it (nothing if it is empty)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        return
    to.write(f"---- {path} ----\n")
    to.write(text if text.endswith("\n") or not text else text + "\n")
    to.write(f"---- end of {path} ----\n")
    to.flush()


def terminal_err() -> TextIO:
    """The terminal's stderr: inside a stage the one stage_log saved, else sys.stderr."""
    return _active.err if _active else sys.stderr


def progress(iterable: Any = None, *, desc: str, total: int | None = None, unit: str = "it", **kwargs):
    """A tqdm bar on the terminal's stderr, drawn only when it is a TTY; cleared when done."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, unit=unit, file=terminal_err(), disable=None, leave=False, **kwargs)


@contextlib.contextmanager
def log_progress(pattern: str, *, desc: str, unit: str = "it") -> Iterator[None]:
    """A progress bar that advances on each library output line matching `pattern` (by the number in
    its first group, if it has one), e.g. llm-compressor's `Quantizing 7 module(s)`. Drawn from the
    first match on, inside a stage only."""
    if _active is None:
        yield
        return
    regex, bar = re.compile(pattern), None

    def watch(text: str) -> None:
        nonlocal bar
        for m in regex.finditer(text):
            if bar is None:  # not `bar or ...`: a tqdm without total has no truth value
                bar = progress(desc=desc, unit=unit, bar_format="{desc}: {n_fmt} {unit}s [{elapsed}]")
            bar.update(int(m.group(1)) if regex.groups else 1)

    stage = _active
    stage.watchers.append(watch)
    try:
        yield
    finally:
        stage.watchers.remove(watch)
        if bar is not None:
            bar.close()


def shown(path: Path) -> str:
    """`path` relative to the working folder where it lies under it (as the user typed it), else as is."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
