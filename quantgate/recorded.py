"""The recorded calibration set: conversations the 16-bit build answered once, kept in git.

Sampled answers from a batched CPU (or GPU) server are not bit-stable: two runs of the calibrate stage on
one machine gave two sets with no conversation in common, so two clones of one commit made different
int8 builds. The set is therefore made once, on request (`make calibration`), and recorded beside the
prompts as two files that travel with the commit:

- `<stem>.jsonl`: one `{"messages": [{"role", "content"}, ...]}` per line, in the order they were packed;
- `<stem>.json`: what it was made with (the prompts' content digest, min_tokens, max_answer_tokens,
  temperature, seed), the 16-bit build it was made from (weights and config digests), how many, the sha256
  of the .jsonl, and where and when (machine kind, dtype, date).

The calibrate stage reads it and refuses a record made with other settings, from another model, or edited
since it was made: each of those would make a build from data its lineage does not name.
"""

from __future__ import annotations

import json
from pathlib import Path

from quantgate.calibration import is_chat
from quantgate.errors import QuantgateError
from quantgate.files import write_whole
from quantgate.hashing import sha256_file
from quantgate.jsonl import read_jsonl

REMAKE = "make one with `make calibration` (the 16-bit build answers the prompts: minutes)"


def record_files(stem: Path) -> tuple[Path, Path]:
    """(conversations .jsonl, description .json) of the recorded set named by `stem` (calibrate.recorded)."""
    return stem.with_suffix(".jsonl"), stem.with_suffix(".json")


def write_record(stem: Path, conversations: list[list[dict]], made_with: dict, model: dict, where: dict) -> dict:
    """Write the recorded set `stem` (record_files) and return its description.

    `conversations`: chat message lists; `made_with`: the generation settings; `model`: the 16-bit build's
    {"weights_digest", "config_digest"}; `where`: free facts (machine kind, dtype, date). Each file is
    written whole to a temporary name and renamed, so a reader never sees half a record."""
    data, meta = record_files(stem)
    data.parent.mkdir(parents=True, exist_ok=True)
    write_whole(data, "".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in conversations))
    description = {
        "made_with": made_with,
        "model": model,
        "conversations": len(conversations),
        "sha256": sha256_file(data),
        **where,
    }
    write_whole(meta, json.dumps(description, indent=2) + "\n")
    return description


def _other_settings(recorded_with: dict, made_with: dict) -> str | None:
    """Which settings of `made_with` the record was not made with, and what to do; None when it was."""
    if differ := [k for k in sorted(made_with) if recorded_with.get(k) != made_with[k]]:
        said = ", ".join(f"{k} {recorded_with.get(k)!r} vs {made_with[k]!r} now" for k in differ)
        return f"recorded with other calibrate settings ({said}); restore them or {REMAKE}"
    return None


def _description(meta: Path) -> dict:
    """A record's description (`<stem>.json`), its `made_with` and `model` mappings in it; raises QuantgateError
    naming the file when it is missing or is no such description."""
    try:
        description = json.loads(meta.read_text())
    except FileNotFoundError:
        raise QuantgateError(f"{meta}: no recorded calibration set (calibrate.recorded); {REMAKE}") from None
    except (OSError, ValueError):
        description = None
    if not (
        isinstance(description, dict) and all(isinstance(description.get(k), dict) for k in ("made_with", "model"))
    ):
        raise QuantgateError(f"{meta}: not a recorded set's description; {REMAKE}")
    return description


def settings_problem(stem: Path, made_with: dict) -> str | None:
    """What read_record would refuse in the record's description alone, before any model exists: "<stem>.json:
    recorded with other calibrate settings (...)" or a missing or unreadable description; None when it suits.
    validate asks it so that a changed calibrate setting stops the run before prepare, not at calibrate."""
    meta = record_files(stem)[1]
    try:
        recorded_with = _description(meta)["made_with"]
    except QuantgateError as exc:
        return str(exc)
    problem = _other_settings(recorded_with, made_with)
    return problem and f"{meta}: {problem}"


def read_record(stem: Path, made_with: dict, model: dict) -> list[tuple[str, list[dict]]]:
    """The recorded conversations of `stem` as (source `<file>:<line>`, messages), in recorded order.

    Raises QuantgateError in one line, naming the file and what to do, when the record is missing or
    unreadable, its .jsonl is not the one its .json describes (edited by hand), it was made with settings
    other than `made_with` (each differing field named), or from a 16-bit build other than `model`."""
    data, meta = record_files(stem)
    if not data.is_file() or not meta.is_file():
        missing = data if not data.is_file() else meta
        raise QuantgateError(f"{missing}: no recorded calibration set (calibrate.recorded); {REMAKE}")
    description = _description(meta)
    recorded_with, recorded_model = description["made_with"], description["model"]
    if sha256_file(data) != description.get("sha256"):
        raise QuantgateError(
            f"{data}: changed since it was recorded (its sha256 is not the one {meta.name} holds); restore it "
            f"(`git checkout {data}`) or {REMAKE}"
        )
    if problem := _other_settings(recorded_with, made_with):
        raise QuantgateError(f"{meta}: {problem}")
    if differ := [k for k in sorted(model) if recorded_model.get(k) != model[k]]:
        raise QuantgateError(
            f"{meta}: recorded from another 16-bit build ({', '.join(differ)} differ from models/fp16's); {REMAKE}"
        )
    out = []
    for number, row in read_jsonl(data, REMAKE):
        messages = row.get("messages") if isinstance(row, dict) else None
        if not is_chat(messages):
            raise QuantgateError(
                f'{data}:{number}: expected {{"messages": [{{"role": "user"|"assistant"|"system", "content": "..."}}, '
                f"...]}}; {REMAKE}"
            )
        out.append((f"{data}:{number}", messages))
    return out
