"""User-facing errors and the two wrappers that turn them into one clear line and an exit code.

Every stage's `main()` runs under `run_main`, so what a user sees on bad input is
`quantgate: error: <what is wrong and what to do>` (exit 2) and never a traceback; with `log=` the
stage's library output goes to results/logs/ and is shown whole before the error (quantgate/console.py).
Every `quantgate` command runs its work under `command_errors`: click's `Error: <what is wrong and
what to do>` (exit 1).
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from quantgate.console import stage_log


class QuantgateError(Exception):
    """An error the user can act on; its message names the file/field and the fix."""


def _terminated(signum, frame):
    raise SystemExit(143)


def run_main(fn: Callable[[], None], log: str | None = None) -> None:
    """Run a stage entry point; print QuantgateError as one line and exit 2.

    With `log` (the DVC stage name, e.g. `quantize@int4`) it runs under console.stage_log: library
    output goes to results/logs/<log>.log, named in the last line, and shown whole on any error.
    Raises SystemExit(2) on QuantgateError, SystemExit(130) on Ctrl-C, SystemExit(143) on
    SIGTERM (turned into an exception so `finally` blocks stop child servers). Other
    exceptions are bugs: without `log` they propagate; with it their traceback ends the log
    that is shown, and the exit code is 1.
    """
    signal.signal(signal.SIGTERM, _terminated)
    try:
        if log is None:
            fn()
        else:
            with stage_log(log, expected=(QuantgateError,)):
                fn()
    except QuantgateError as exc:
        print(f"quantgate: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("quantgate: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except Exception:
        if log is None:
            raise
        raise SystemExit(1) from None  # the shown log ends with the traceback


@contextlib.contextmanager
def command_errors(
    also: tuple[type[Exception], ...] = (), describe: Callable[[Exception], str] = str
) -> Iterator[None]:
    """The one error path of every `quantgate` command: a QuantgateError, or an exception of a type in
    `also` (e.g. MlflowException, worded by `describe`), becomes click's one-line `Error: ...`, exit 1."""
    import click

    try:
        yield
    except QuantgateError as exc:
        raise click.ClickException(str(exc)) from None
    except also as exc:
        raise click.ClickException(describe(exc)) from None


def project_relative(text: str, root: Path | None = None) -> str:
    """`text` (a reason, a message) with the project's absolute path `root` (default: the working directory,
    where DVC runs every stage) removed, so records name `models/int4`, not the clone's full path."""
    return text.replace(f"{(root or Path.cwd()).resolve()}/", "").replace(f"{root or Path.cwd()}/", "")
