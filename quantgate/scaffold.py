"""`quantgate evals new TEAM`: write a team folder that validates as it is.

The folder holds a policy (team.yaml), one multiple-choice lm-eval task and example
documents, enough of them for identical builds to PASS at the default margin, so the team
can run `dvc repro` at once and then replace the documents with its own.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from quantgate.checks import min_docs_to_pass
from quantgate.errors import QuantgateError
from quantgate.files import dangling, linked, special_kind
from quantgate.teams import TEAM_NAME, TEAM_NAME_RULE, Team, declared_under, load_team

DEFAULT_MARGIN, DEFAULT_CONFIDENCE = 0.05, 0.95

POLICY = """\
# Gate policy of team {name} (every field: evals/README.md).
owner: {owner}
contact: {contact}
metric: acc               # per-document metric the gate compares (must be in the task's metric_list)
higher_is_better: true
margin:
  absolute: {margin}          # most a build may lose vs the 16-bit build, in metric units
confidence: {confidence}          # one-sided confidence of the non-inferiority bound
chat_template: false      # true: prompts go through the model's chat template, as served
"""

TASK = """\
# Team {name}: replace data.jsonl with your documents (same fields), keep `answer` an INDEX
# into `choices`, and check with `quantgate evals validate evals/{name}`.
task: {name}_example
dataset_path: json
dataset_kwargs:
  data_files:
    test: data.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def example_docs(name: str, n: int) -> list[dict]:
    """`n` distinct two-way questions ("Which number is larger?"), deterministic per team name."""
    rng = random.Random(name)
    docs, drawn = [], set()
    for i in range(n):
        a, b = rng.sample(range(1, 100), 2)
        while (a, b) in drawn:  # a repeat is refused by validate (scored twice); names without one keep their docs
            a, b = rng.sample(range(1, 100), 2)
        drawn.add((a, b))
        choices = [str(a), str(b)]
        docs.append(
            {
                "id": f"{name}-{i:03d}",
                "question": f"Which number is larger, {a} or {b}?",
                "choices": choices,
                "answer": choices.index(str(max(a, b))),
            }
        )
    return docs


def new_team(root: Path, name: str, owner: str, contact: str) -> Team:
    """Write evals/<name>/ (team.yaml, <name>.yaml, data.jsonl), validate it beside the other teams under
    `root`, and return it as loaded.

    Raises QuantgateError if the name is not lower_snake_case (2-40 chars), the folder exists (or is a symlink: to
    a file, FIFO or device, named with its target, broken or a loop), another team's folder declares its task
    `<name>_example`, it cannot be written, or it does not validate; then nothing of it is left under `root` (the
    files are written in a hidden folder beside it, renamed into place whole, and removed if they do not validate).
    """
    if not TEAM_NAME.fullmatch(name):
        raise QuantgateError(f"team name {name!r}: {TEAM_NAME_RULE}")
    if blank := [flag for flag, value in (("--owner", owner), ("--contact", contact)) if not value.strip()]:
        # name the one left blank: "--owner and --contact" sent a user with a good --contact looking for a fault
        raise QuantgateError(f"{' and '.join(blank)} must not be empty: they say whom the gate reports to")
    if not root.is_dir():
        state = "not a folder" if root.exists() else "does not exist"
        raise QuantgateError(f"{root}: {state}; --root is the folder that holds the team folders (evals/)")
    folder = root / name
    if folder.exists():
        if folder.is_dir():
            raise QuantgateError(f"{folder} already exists; pick another name or edit that folder")
        kind = linked(folder, "a file" if folder.is_file() else special_kind(folder))  # a link: "is a file" misled
        raise QuantgateError(f"{folder} already exists and is {kind}, not a team folder; pick another name or move it")
    if folder.is_symlink():  # to nothing: the rename into place would fail "Not a directory"
        raise QuantgateError(
            f"{folder} is {dangling(folder)}; remove the link (a team folder is written in place, never through a "
            "symlink) or pick another name"
        )
    if clash := _task_taken(root, name):
        raise QuantgateError(clash)
    n = min_docs_to_pass(DEFAULT_MARGIN, DEFAULT_CONFIDENCE) + 8
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".new-{name}-", dir=root))  # hidden: never read as a team
    except OSError as exc:
        raise QuantgateError(f"cannot write in {root}: {exc.strerror or exc}; give a writable --root") from None
    try:
        _write(staging / name, name, owner, contact, n)
        try:
            os.rename(staging / name, folder)  # whole, or not at all; refused if a non-empty folder appeared
        except OSError as exc:
            raise QuantgateError(f"cannot create {folder}: {exc.strerror or exc}") from None
        try:
            return load_team(folder)  # with the teams beside it: its task name must be free among theirs
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _task_taken(root: Path, name: str) -> str | None:
    """Why the task the scaffold names (`<name>_example`, TASK) cannot be written under `root`: a team folder
    there already declares it (validate would refuse the scaffold, and the scaffold is then removed), or None."""
    task = f"{name}_example"
    for found in declared_under(root).values():
        for declared, file in found:
            if declared == task:
                return (
                    f"task name {task!r}, the one `evals new {name}` writes, is already used by {file}; pick "
                    "another team name (nothing was written)"
                )
    return None


def _write(folder: Path, name: str, owner: str, contact: str, n: int) -> None:
    """The scaffold's three files in `folder` (created), with `n` example documents."""
    folder.mkdir()
    (folder / "team.yaml").write_text(
        POLICY.format(
            name=name,
            # a JSON string is a YAML double-quoted one; not ASCII-escaped: YAML reads JSON's surrogate pair for
            # an emoji ("\ud83d\ude80") as two lone surrogates, which team.yaml's check then refused
            owner=json.dumps(owner, ensure_ascii=False),
            contact=json.dumps(contact, ensure_ascii=False),
            margin=DEFAULT_MARGIN,
            confidence=DEFAULT_CONFIDENCE,
        ),
        encoding="utf-8",
    )
    (folder / f"{name}.yaml").write_text(TASK.format(name=name))
    (folder / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in example_docs(name, n)))
