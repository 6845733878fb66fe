"""User-facing errors and the wrapper that turns them into one clear line and an exit code.

Every stage's `main()` runs under `run_main`, so what a user sees on bad input is
`quantgate: error: <what is wrong and what to do>` and never a traceback.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable


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
