"""User-facing errors and the two wrappers that turn them into one clear line and an exit code.

Every stage's `main()` runs under `run_main`, so what a user sees on bad input is
`quantgate: error: <what is wrong and what to do>` (exit 2) and never a traceback. Every `quantgate`
command runs its work under `command_errors`: click's `Error: <what is wrong and what to do>` (exit 1).
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterator


class QuantgateError(Exception):
    """An error the user can act on; its message names the file/field and the fix."""


def _terminated(signum, frame):
    raise SystemExit(143)


def run_main(fn: Callable[[], None]) -> None:
    """Run a stage entry point; print QuantgateError as one line and exit 2.

    Raises SystemExit(2) on QuantgateError, SystemExit(130) on Ctrl-C, SystemExit(143) on
    SIGTERM (turned into an exception so `finally` blocks stop child servers). Other
    exceptions propagate (they are bugs, and the traceback is what a developer needs).
    """
    signal.signal(signal.SIGTERM, _terminated)
    try:
        fn()
    except QuantgateError as exc:
        print(f"quantgate: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("quantgate: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


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
