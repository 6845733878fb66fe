"""A task's data files: which files it names, and their documents as lm-eval will read them.

`data_files` resolves a task's `dataset_kwargs.data_files` to regular files inside the team folder (never a
symlink); `read_rows` reads them with quantgate's own line rules (checks.read_docs), then through the datasets
loader lm-eval uses (quantgate/loader.py), and pairs each line's document as written with the document the
loader returns for it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from quantgate.checks import Row, read_docs
from quantgate.files import special_kind
from quantgate.loader import LoaderRefused, load_splits, refused_line


def capped(file: Path, found: list[str], most: int = 20) -> list[str]:
    """The first `most` problems of one file, and a count of the rest."""
    return found[:most] + ([f"{file}: ... and {len(found) - most} more"] if len(found) > most else [])


def data_files(path: Path, files: dict, where: Callable[..., str], problems: list[str]) -> dict[str, Path] | None:
    """{split: resolved path} of a task's data files (`files`: its dataset_kwargs.data_files, relative to the task
    YAML at `path`), each a regular file inside the team folder; None (and the problems appended) if any is not.
    `where(*key path)` names the task file's line (templates.key_locator)."""
    resolved, folder = {}, path.parent.resolve()
    for name, rel in files.items():
        at = f"{where('dataset_kwargs', 'data_files', name)}: dataset_kwargs.data_files.{name}"
        given = path.parent / str(rel)
        if isinstance(rel, str) and given.is_symlink():
            problems.append(
                f"{at}: {rel} is a symlink (to {given.readlink()}); a data file must be a regular file in the team "
                "folder (its digest and the evaluation cache cover only the folder's own files): copy it in"
            )
        elif not isinstance(rel, str) or not given.resolve().is_relative_to(folder):
            problems.append(
                f"{at}: {rel!r} must be one file inside the team folder (its digest and the evaluation cache "
                "cover only that folder)"
            )
        elif given.is_dir():
            problems.append(f"{at}: {rel} is a folder; name the JSONL file (one document per line) in it")
        elif not given.exists():
            problems.append(f"{at}: {rel} not found next to the task file")
        elif not given.is_file():  # never opened: reading a FIFO with no writer waits forever
            problems.append(
                f"{at}: {rel} is {special_kind(given)}, not a regular file; a data file must be a JSONL file "
                "in the team folder: write the documents to a file"
            )
        else:
            resolved[name] = given.resolve()
    return resolved if len(resolved) == len(files) else None


def read_rows(
    files: dict[str, Path], where: Callable[..., str], problems: list[str], refused: set[str] | None = None
) -> dict[str, list[Row]] | None:
    """{split: [(line, document as written, document as lm-eval's loader returns it)]} of a task's data files:
    quantgate's own line rules first (checks.read_docs), then the datasets loader lm-eval uses, with the same
    options (quantgate/loader.py). Lines quantgate's rules refuse are left out (and their problems appended),
    so the other lines are still checked when the loader reads the file; None (and the problems appended)
    when a file has no document, or the loader refuses the files or reads them otherwise than line by line.
    `refused`, if given, receives the splits of which quantgate's rules refused lines (the loader read them)."""
    written, text, own = {}, {}, False
    for name, file in files.items():  # every file's own problems are listed, even after one with no document
        found, docs, lines = read_docs(file)
        if not docs and not found:
            found = [f"{file}: no documents; add one JSON object per line"]
        problems += capped(file, found)
        if found and refused is not None:
            refused.add(name)
        written[name], text[name], own = docs, lines, own or bool(found)
    if not all(written.values()):
        return None
    try:
        loaded = load_splits({name: str(file) for name, file in files.items()})
    except LoaderRefused as exc:
        if own:  # the loader refuses what quantgate's rules have named, line by line
            return None
        for name, file in files.items():
            if (line := refused_line(text[name])) is not None:
                problems.append(
                    f"{file}:{line}: the datasets JSON loader that lm-eval reads this file with refuses it "
                    f"({exc.reason}); fix that line"
                )
                return None
        names = ", ".join(f.name for f in files.values())
        problems.append(
            f"{where('dataset_kwargs', 'data_files')}: the datasets JSON loader that lm-eval reads {names} with "
            f"refuses them together ({exc.reason}); give every file of a task the same fields, of the same types"
        )
        return None
    rows = {}
    for name, file in files.items():
        filled = [n for n, line in enumerate(text[name], 1) if line.strip()]  # the loader's rows: one a line
        if len(loaded[name]) != len(filled):
            if not own:  # quantgate's rules leave one JSON object a line; this would be the loader's own reading
                problems.append(
                    f"{file}: the datasets loader reads {len(loaded[name])} documents from its {len(filled)} "
                    "lines; write one JSON object per line"
                )
            return None
        got = dict(zip(filled, loaded[name], strict=True))
        rows[name] = [(n, doc, got[n]) for n, doc in written[name]]
    return rows
