"""A team's calibration conversations (`evals/<team>/calibration.jsonl`, optional) and the rule that keeps
eval documents out of calibration data.

The validate stage and `quantgate evals validate` check a team's file when it is submitted; the calibrate
stage checks it again with the same function and puts its conversations first. Calibrating on the documents
that gate a build leaks the test into the build, so no calibration text (a team's conversation, a shipped
prompt, a generated answer) may contain a string of any team's eval documents.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from quantgate.errors import QuantgateError
from quantgate.jsonl import read_jsonl
from quantgate.teams import Team

TEAM_FILE = "calibration.jsonl"  # optional, in a team's folder
MIN_OVERLAP_CHARS = 20  # shorter eval strings ("Paris", "42") occur in any text by chance...
MIN_OVERLAP_WORDS = 4  # ...unless they are a phrase of their own ("What is 4 - 1?", 14 characters, 4 words)
CHECKED = (  # what a pass says
    f"none quotes an eval document's text of {MIN_OVERLAP_CHARS}+ characters or {MIN_OVERLAP_WORDS}+ words"
)
ROLES = ("system", "user", "assistant")
SHAPE = '{"messages": [{"role": "user"|"assistant"|"system", "content": "..."}, ...]}'  # one line of TEAM_FILE


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _data_files(config: dict) -> list[Path]:
    files = (config.get("dataset_kwargs") or {}).get("data_files") or []
    return [Path(f) for f in _strings(files)]


def is_chat(messages) -> bool:
    """True for a non-empty list of {"role": system|user|assistant, "content": str} messages."""
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages)
    )


def eval_strings(teams: list[Team]) -> dict[str, str]:
    """Every string field of every team's eval documents, normalized (lower case, single spaces), mapped to
    where it is (`<file>:<line>`). Strings under MIN_OVERLAP_CHARS characters and MIN_OVERLAP_WORDS words
    (space-separated) are left out: a place or a number alone is no leak."""
    found: dict[str, str] = {}
    for team in teams:
        for task in team.tasks:
            for path in _data_files(task.config):
                if not path.is_file():  # data files are JSONL whatever their suffix (checks.read_docs)
                    continue
                for number, doc in read_jsonl(path, "check the eval sets with `quantgate evals validate`", loader=True):
                    for s in _strings(doc):
                        n = _norm(s)
                        if len(n) >= MIN_OVERLAP_CHARS or len(n.split()) >= MIN_OVERLAP_WORDS:
                            found.setdefault(n, f"{path}:{number}")
    return found


def overlap(text: str, strings: dict[str, str]) -> str | None:
    """Where an eval document found in `text` lives (`<file>:<line>`), or None."""
    norm = _norm(text)
    return next((where for s, where in strings.items() if s in norm), None)


def team_conversations(teams: list[Team], strings: dict[str, str] | None = None) -> list[tuple[str, list[dict]]]:
    """The conversations of every team's TEAM_FILE: (source `<file>:<line>`, messages), taken in turn from each
    team (its first, then each team's second, ...), so that any first n of them (the search's KL ranking reads
    the first `search.kl_samples`) hold every team's kind of text.

    `strings` are eval_strings(teams); without them they are read here, and only if some team has the file.
    Raises QuantgateError naming the file and line of a malformed conversation or one that contains an eval
    document of any team in `teams`.
    """
    per_team = []
    for team in teams:
        path = team.path / TEAM_FILE
        if path.is_symlink():  # it goes into every build: the file itself must be in the team folder
            raise QuantgateError(
                f"{path}: a symlink (to {path.readlink()}); {TEAM_FILE} must be a regular file in the team folder: "
                "copy it in"
            )
        if path.exists() and not path.is_file():
            raise QuantgateError(f"{path}: not a file; {TEAM_FILE} is one JSON object per line ({SHAPE})")
        if not path.is_file():
            continue
        if strings is None:
            strings = eval_strings(teams)
        per_team.append(_read_team_file(path, strings))
    return [row for turn in itertools.zip_longest(*per_team) for row in turn if row is not None]


def _read_team_file(path: Path, strings: dict[str, str]) -> list[tuple[str, list[dict]]]:
    """(source `<file>:<line>`, messages) of each conversation of one team's TEAM_FILE at `path`. Raises
    QuantgateError naming the file (and line) of a file with no conversation (empty, or blank lines only: a team
    that adds the file means to add some), a line not in the chat shape, a conversation with no text (every
    content blank: it would calibrate on the chat template alone) or one that quotes an eval document
    (`strings`: eval_strings)."""
    own = []
    for number, row in read_jsonl(path, f"write each line as one JSON object, {SHAPE}", by_hand=True):
        where = f"{path}:{number}"
        messages = row.get("messages") if isinstance(row, dict) else None
        if not is_chat(messages):
            raise QuantgateError(f"{where}: expected {SHAPE}")
        if not any(m["content"].strip() for m in messages):
            raise QuantgateError(
                f"{where}: this calibration conversation has no text (every content is blank), so it would "
                "calibrate on the chat template alone; write what was said, or remove the line"
            )
        if found := overlap(" ".join(m["content"] for m in messages), strings):
            raise QuantgateError(
                f"{where}: this calibration conversation contains the eval document at {found}; calibrating on "
                "eval data leaks the test into the build: remove it"
            )
        own.append((where, messages))
    if not own:
        raise QuantgateError(
            f"{path}: no conversations (the file is empty, or blank lines only); write one per line, {SHAPE}, or "
            f"delete the file ({TEAM_FILE} is optional)"
        )
    return own
