"""A task's data files read the way lm-eval reads them: one `datasets.load_dataset("json", data_files=...)` call.

lm-eval 0.4.13's ConfigurableTask.download calls `datasets.load_dataset(path=dataset_path, name=None,
**dataset_kwargs)`; a team task has `dataset_path: json` and `dataset_kwargs: {data_files: {split: file}}`
(quantgate/checks.py allows nothing else), so `load_splits(data_files)` makes the same call and returns the
documents every split holds, as lm-eval's `test_docs()` / `fewshot_docs()` iterate them. The loader's
choices are kept: features inferred from the first split's first block and cast onto every split, a field
a line lacks read as None, integers mixed with floats read as floats, a UTF-8 byte-order mark and CRLF
line ends accepted.

The loader writes an Arrow cache; here it goes to a temporary folder removed afterwards (the user's
~/.cache and the repository get nothing), and the datasets' progress bars and error log are silenced for
the call.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class LoaderRefused(Exception):
    """The datasets JSON loader refused a task's data files: `reason` is its own innermost message (one line)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _innermost(exc: BaseException) -> BaseException:
    """The exception at the bottom of `exc`'s `raise ... from` chain (DatasetGenerationError wraps pyarrow's;
    the loader's own fallbacks, which only add their errors as context, are passed over)."""
    seen = {id(exc)}
    while (nxt := exc.__cause__) is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        exc = nxt
    return exc


def _reason(exc: BaseException, most: int = 300) -> str:
    """`exc`'s innermost error as one line: its type and message, whitespace runs as one space, cut at `most`."""
    inner = _innermost(exc)
    text = " ".join(str(inner).split()) or "no message"
    return f"{type(inner).__name__}: {text if len(text) <= most else text[: most - 3] + '...'}"


@contextmanager
def _quiet() -> Iterator[None]:
    """The datasets library's progress bars and logging off for the block, restored after."""
    import datasets

    level = datasets.logging.get_verbosity()
    bars = datasets.utils.is_progress_bar_enabled()
    # CRITICAL, not ERROR: the json builder logs a file it refuses ("Failed to load JSON ... row 4", rows counted
    # from 0) before raising; quantgate says it once, at the file's line
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def load_splits(data_files: dict[str, str]) -> dict[str, list[dict]]:
    """{split: [document, ...]} as lm-eval's datasets loader returns them for `data_files` ({split: absolute
    path}), documents in file order.

    Raises LoaderRefused with the loader's own reason when it refuses the files (a key given twice on a line,
    a field whose type it cannot reconcile across splits, ...).
    """
    import datasets

    with _quiet(), tempfile.TemporaryDirectory(prefix="quantgate-datasets-") as cache:
        try:
            loaded = datasets.load_dataset("json", data_files=dict(data_files), cache_dir=cache, keep_in_memory=True)
            return {split: list(loaded[split]) for split in data_files}
        except Exception as exc:  # the loader's errors have no common base (Arrow, pandas, ujson, StopIteration)
            raise LoaderRefused(_reason(exc)) from None


def refused_line(lines: list[str], split: str = "test") -> int | None:
    """The line (1-based, of `lines`: a file's text split at newlines) at which the loader first refuses the file
    alone, or None when it reads the file alone (the refusal then comes from the splits together).

    Bisects over prefixes of the file, one load per step (about log2(lines) loads, each a few milliseconds).
    """
    with tempfile.TemporaryDirectory(prefix="quantgate-prefix-") as tmp:

        def refuses(k: int) -> bool:
            path = Path(tmp) / f"{k}.jsonl"
            path.write_text("\n".join(lines[:k]) + "\n", encoding="utf-8")
            try:
                load_splits({split: str(path)})
            except LoaderRefused:
                return True
            return False

        if not refuses(len(lines)):
            return None
        lo, hi = 0, len(lines)  # refuses(hi) holds; refuses(lo) does not (an empty prefix counts as read)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if refuses(mid):
                hi = mid
            else:
                lo = mid
        return hi
