"""`quantgate evals new TEAM`: write a team folder that validates as it is.

The folder holds a policy (team.yaml), one multiple-choice lm-eval task and example
documents, enough of them for identical builds to PASS at the default margin, so the team
can run `dvc repro` at once and then replace the documents with its own.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from quantgate.checks import min_docs_to_pass
from quantgate.errors import QuantgateError
from quantgate.teams import TEAM_NAME

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
    """`n` two-way questions ("Which number is larger?"), deterministic per team name."""
    rng = random.Random(name)
    docs = []
    for i in range(n):
        a, b = rng.sample(range(1, 100), 2)
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


def new_team(root: Path, name: str, owner: str, contact: str) -> Path:
    """Write evals/<name>/ (team.yaml, <name>.yaml, data.jsonl) and return its path.

    Raises QuantgateError if the name is not lower_snake_case (2-40 chars) or the folder exists.
    """
    if not TEAM_NAME.match(name):
        raise QuantgateError(f"team name {name!r}: use lower_snake_case, 2-40 characters, starting with a letter")
    if not owner.strip() or not contact.strip():
        raise QuantgateError("--owner and --contact must not be empty: they say whom the gate reports to")
    if not root.is_dir():
        raise QuantgateError(f"{root}: not a folder; --root is the folder that holds the team folders (evals/)")
    folder = root / name
    if folder.exists():
        raise QuantgateError(f"{folder} already exists; pick another name or edit that folder")
    n = min_docs_to_pass(DEFAULT_MARGIN, DEFAULT_CONFIDENCE) + 8
    folder.mkdir(parents=True)
    (folder / "team.yaml").write_text(
        POLICY.format(
            name=name,
            owner=json.dumps(owner),
            contact=json.dumps(contact),
            margin=DEFAULT_MARGIN,
            confidence=DEFAULT_CONFIDENCE,
        )
    )
    (folder / f"{name}.yaml").write_text(TASK.format(name=name))
    (folder / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in example_docs(name, n)))
    return folder
