"""Load team eval sets from evals/<team>/ into typed objects.

A team folder holds `team.yaml` (the gate policy) and one or more standard lm-eval task
YAMLs (any other *.yaml with a `task:` key) whose `dataset_kwargs.data_files` name JSONL
files relative to the folder. Files starting with "_" are shared templates, not tasks.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, model_validator

from pipeline.errors import QuantgateError
from pipeline.hashing import digest_tree
from pipeline.params import Frozen, parse, read_yaml

POLICY_FILE = "team.yaml"


class Margin(Frozen):
    """Non-inferiority margin: exactly one of `absolute` (metric units, 0.05 = 5 points of
    accuracy) or `relative` (percent of the 16-bit build's score)."""

    absolute: float | None = Field(default=None, gt=0, le=0.5)
    relative: float | None = Field(default=None, gt=0, le=50)

    @model_validator(mode="after")
    def _exactly_one(self):
        if (self.absolute is None) == (self.relative is None):
            raise ValueError("give exactly one of margin.absolute (e.g. 0.05) or margin.relative (percent, e.g. 5)")
        return self

    def points(self, baseline: float) -> float:
        """The margin in metric units given the 16-bit build's score `baseline`."""
        return self.absolute if self.absolute is not None else abs(baseline) * self.relative / 100.0


class TeamPolicy(Frozen):
    """The gate policy a team owns (evals/<team>/team.yaml)."""

    owner: str = Field(min_length=1)
    contact: str = Field(min_length=1)
    metric: str = Field(min_length=1)       # per-sample metric name in the task's metric_list
    higher_is_better: bool = True
    margin: Margin
    confidence: float = Field(default=0.95, ge=0.5, lt=1.0)
    chat_template: bool = False
    limit: int | None = Field(default=None, gt=0)  # evaluate only the first N docs per task


@dataclass(frozen=True)
class Task:
    """One lm-eval task: `config` is the task YAML with data paths made absolute."""

    name: str
    path: Path
    config: dict


@dataclass(frozen=True)
class Team:
    """A team's eval set: its folder, policy, tasks and a digest over every file in the folder."""

    name: str
    path: Path
    policy: TeamPolicy
    tasks: tuple[Task, ...]
    digest: str


MAX_DATA_BYTES = 50 * 1024 * 1024  # a team set larger than this is almost surely a mistake


def _field(template) -> str | None:
    """The document field a template is exactly `{{field}}` or `field` of, else None."""
    if not isinstance(template, str):
        return None
    t = template.strip()
    if t.startswith("{{") and t.endswith("}}"):
        t = t[2:-2].strip()
    return t if t.isidentifier() else None


def check_data(task_path: Path, config: dict, data_path: Path) -> list[str]:
    """Problems in one JSONL data file, each as "file:line: what is wrong; the fix".

    Checks: size limit, UTF-8, blank lines, invalid JSON, non-object lines, and for
    multiple_choice tasks a target that is not a valid index into the choices (or is the
    answer text instead of the index), and empty or duplicate choices.
    """
    raw = data_path.read_bytes()
    if len(raw) > MAX_DATA_BYTES:
        return [f"{data_path}: {len(raw)} bytes is over the {MAX_DATA_BYTES} byte limit; split or sample the set"]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        return [f"{data_path}:{line}: not UTF-8 (byte 0x{raw[exc.start]:02x}); save the file as UTF-8"]
    problems = []
    mc = config.get("output_type") == "multiple_choice"
    target_field, choice_field = _field(config.get("doc_to_target")), _field(config.get("doc_to_choice"))
    fixed_choices = config.get("doc_to_choice") if isinstance(config.get("doc_to_choice"), list) else None
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            if n < len(text.split("\n")):  # a final newline is fine
                problems.append(f"{data_path}:{n}: blank line; remove it")
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"{data_path}:{n}: invalid JSON ({exc.msg} at column {exc.colno})")
            continue
        if not isinstance(doc, dict):
            problems.append(f"{data_path}:{n}: a line must be a JSON object, got {type(doc).__name__}")
            continue
        if not mc or target_field is None:
            continue
        choices = fixed_choices if fixed_choices is not None else doc.get(choice_field) if choice_field else None
        if choices is None:
            if choice_field:
                problems.append(f"{data_path}:{n}: field {choice_field!r} (doc_to_choice) is missing")
            continue
        if not isinstance(choices, list) or not choices or any(not str(c).strip() for c in choices):
            problems.append(f"{data_path}:{n}: choices must be a non-empty list of non-empty strings")
            continue
        if len(set(map(str, choices))) != len(choices):
            problems.append(f"{data_path}:{n}: duplicate choices {choices}; make them distinct")
        if target_field not in doc:
            problems.append(f"{data_path}:{n}: field {target_field!r} (doc_to_target) is missing")
            continue
        target = doc[target_field]
        if isinstance(target, str) and target in map(str, choices):
            problems.append(f"{data_path}:{n}: {target_field} is the answer text {target!r}; "
                            f"use its index {list(map(str, choices)).index(target)} into the choices")
        elif not isinstance(target, int) or isinstance(target, bool) or not 0 <= target < len(choices):
            problems.append(f"{data_path}:{n}: {target_field}={target!r} is not an index into "
                            f"{len(choices)} choices (0..{len(choices) - 1})")
    return problems


def _load_task(path: Path) -> Task | None:
    config = read_yaml(path)
    if not isinstance(config, dict) or "task" not in config:
        return None
    config = copy.deepcopy(config)
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, dict):
        resolved = {}
        for split, rel in files.items():
            p = (path.parent / rel).resolve()
            if not p.is_file():
                raise QuantgateError(f"{path}: dataset_kwargs.data_files.{split}: {rel} not found next to the task file")
            resolved[split] = str(p)
        config["dataset_kwargs"]["data_files"] = resolved
        problems = [msg for f in resolved.values() for msg in check_data(path, config, Path(f))]
        if problems:
            shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
            raise QuantgateError(f"{path.parent.name}: {len(problems)} problem(s) in the data:\n  " + "\n  ".join(shown))
    return Task(name=str(config["task"]), path=path, config=config)


def load_team(path: Path) -> Team:
    """Load one team folder. Raises QuantgateError naming the file and field on bad input."""
    policy_path = path / POLICY_FILE
    policy = parse(TeamPolicy, read_yaml(policy_path), str(policy_path))
    tasks = [t for p in sorted(path.glob("*.yaml")) if p.name != POLICY_FILE and not p.name.startswith("_")
             if (t := _load_task(p)) is not None]
    if not tasks:
        raise QuantgateError(f"{path}: no lm-eval task YAML (a *.yaml with `task:`); see evals/README.md")
    for t in tasks:
        metrics = [m.get("metric") for m in t.config.get("metric_list", [])]
        if policy.metric not in metrics:
            raise QuantgateError(f"{policy_path}: metric {policy.metric!r} is not in metric_list of {t.path} ({metrics})")
    return Team(name=path.name, path=path, policy=policy, tasks=tuple(tasks), digest=digest_tree(path))


def load_teams(root: Path) -> list[Team]:
    """Every team under `root` (folders with a team.yaml), sorted by name.

    Raises QuantgateError if there is none, or if two teams declare the same task name.
    """
    teams = [load_team(p) for p in sorted(root.iterdir()) if (p / POLICY_FILE).is_file()]
    if not teams:
        raise QuantgateError(f"{root}: no team folders (a folder with {POLICY_FILE}); see evals/README.md")
    seen: dict[str, Path] = {}
    for team in teams:
        for task in team.tasks:
            if task.name in seen:
                raise QuantgateError(f"{task.path}: task name {task.name!r} already used by {seen[task.name]}; rename one")
            seen[task.name] = task.path
    return teams
