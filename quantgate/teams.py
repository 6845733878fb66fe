"""Load team eval sets from evals/<team>/ into typed objects.

A team folder holds `team.yaml` (the gate policy) and one or more standard lm-eval task
YAMLs (every other *.yaml must be one) whose `dataset_kwargs.data_files` name JSONL
files relative to the folder. Files starting with "_" are shared templates, not tasks.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, model_validator

from quantgate.checks import BINARY_METRICS, check_data, check_filters, check_metrics, check_task, min_docs_to_pass
from quantgate.errors import QuantgateError
from quantgate.hashing import digest_of, digest_tree, sha256_file
from quantgate.params import Frozen, parse, read_yaml
from quantgate.templates import check_templates, key_locator

POLICY_FILE = "team.yaml"


class Margin(Frozen):
    """Non-inferiority margin: exactly one of `absolute` (metric units, 0.05 = 5 points of
    accuracy) or `relative` (percent of the 16-bit build's score)."""

    absolute: float | None = Field(default=None, ge=0.001, le=0.5)  # below 0.1 point no real set can PASS
    relative: float | None = Field(default=None, ge=0.1, le=50)

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
    metric: str = Field(min_length=1)  # per-sample metric name in the task's metric_list
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
    n_docs: int  # documents the gate will see (test split, after the team's limit)


@dataclass(frozen=True)
class Team:
    """A team's eval set: its folder, policy, tasks and two digests.

    `digest` covers every file in the folder, team.yaml included (the registry's record of
    what the gate judged with); `scores_digest` covers only what lm-eval reads, the task YAMLs
    and their data files (the evaluation cache's key: a policy change re-scores nothing).
    """

    name: str
    path: Path
    policy: TeamPolicy
    tasks: tuple[Task, ...]
    digest: str
    scores_digest: str


MAX_NODES = 100_000  # values a task YAML may expand to: aliases can make a small file enormous


def _size(value, budget: int = MAX_NODES + 1) -> int:
    """Values in a loaded YAML document counted with aliases expanded, stopping past `budget`."""
    count, stack = 0, [value]
    while stack and count <= budget:
        v = stack.pop()
        count += 1
        if isinstance(v, dict):
            stack += [*v.keys(), *v.values()]
        elif isinstance(v, list):
            stack += v
    return count


def _load_task(path: Path, policy: TeamPolicy | None, problems: list[str]) -> Task | None:
    """One task YAML, data paths made absolute; appends every problem found to `problems`."""
    if path.is_symlink():  # its digest and the sandbox's checks cover only the folder's own files
        problems.append(f"{path}: is a link; a task YAML must be a file in the team folder (copy it in)")
        return None
    try:
        config = read_yaml(path)
    except QuantgateError as exc:
        problems.append(str(exc))
        return None
    if _size(config) > MAX_NODES:
        problems.append(f"{path}: expands to over {MAX_NODES} YAML values (aliases of aliases?); write it out plainly")
        return None
    if not isinstance(config, dict):
        problems.append(
            f"{path}: a task YAML must be a mapping (task:, dataset_path:, ...), got a "
            f"{type(config).__name__}; name shared templates with a leading _"
        )
        return None
    if not isinstance(config.get("task"), str):
        problems.append(
            f"{path}: `task:` must be the task's name (a string), got {config.get('task')!r}; "
            "name shared templates with a leading _"
        )
        return None
    config = copy.deepcopy(config)
    where = key_locator(path)
    problems += check_task(path, config)
    unsafe = check_templates(where, config)
    problems += unsafe + check_filters(where, config)
    if policy is not None:
        problems += check_metrics(path, config, policy.metric, policy.higher_is_better)
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if not isinstance(files, dict) or not files:
        problems.append(
            f"{path}: dataset_kwargs.data_files must map a split to a JSONL file in this folder, "
            "e.g. {test: data.jsonl}"
        )
        return None
    split = config.get("test_split") or config.get("validation_split")
    if split not in files:
        problems.append(f"{path}: test_split {split!r} is not a key of dataset_kwargs.data_files {sorted(files)}")
    resolved, n_docs, counts = {}, 0, {}
    for name, rel in files.items():
        p = (path.parent / str(rel)).resolve()
        if not isinstance(rel, str) or not p.is_relative_to(path.parent.resolve()):
            problems.append(
                f"{path}: dataset_kwargs.data_files.{name}: {rel!r} must be one file inside the team "
                "folder (its digest and the evaluation cache cover only that folder)"
            )
            continue
        if not p.is_file():
            problems.append(f"{path}: dataset_kwargs.data_files.{name}: {rel} not found next to the task file")
            continue
        resolved[name] = str(p)
        found, n = check_data(config, p, where, render=not unsafe)
        if n == 0 and not found:
            found = [f"{p}: no documents; add one JSON object per line"]
        problems += found[:20] + ([f"{p}: ... and {len(found) - 20} more"] if len(found) > 20 else [])
        n_docs += n if name == split else 0
        counts[name] = n
    shots, fewshot_split = config.get("num_fewshot"), config.get("fewshot_split")
    if isinstance(shots, int) and fewshot_split in counts and shots > counts[fewshot_split]:
        problems.append(
            f"{where('num_fewshot')}: num_fewshot {shots} but the {fewshot_split!r} split has {counts[fewshot_split]} "
            "documents; add examples or lower num_fewshot"
        )
    config["dataset_kwargs"]["data_files"] = resolved
    if policy is not None and policy.limit:
        n_docs = min(n_docs, policy.limit)
    return Task(name=str(config["task"]), path=path, config=config, n_docs=n_docs)


def min_docs(policy: TeamPolicy) -> int | None:
    """Fewest documents with which identical builds can PASS under `policy` (0/1 metrics;
    None for continuous ones). A relative margin is taken at its widest, on a perfect score of 1."""
    if policy.metric not in BINARY_METRICS:
        return None
    return min_docs_to_pass(policy.margin.points(1.0), policy.confidence)


TEAM_NAME = re.compile(r"^[a-z][a-z0-9_]{1,39}$")  # also an MLflow tag key part (gate.<team>.verdict)


def inspect_team(path: Path) -> tuple[Team | None, list[str]]:
    """Load one team folder and collect every problem; the Team is None if it cannot be built."""
    policy_path = path / POLICY_FILE
    problems: list[str] = []
    if not TEAM_NAME.match(path.name):
        problems.append(
            f"{path}: team folder name {path.name!r}: use lower_snake_case, 2-40 characters, "
            "starting with a letter (it names the team in tags and reports)"
        )
    policy = None
    try:
        policy = parse(TeamPolicy, read_yaml(policy_path), str(policy_path), policy_path)
    except QuantgateError as exc:
        problems.append(str(exc))
    tasks = [
        t
        for p in sorted(path.glob("*.yaml"))
        if p.name != POLICY_FILE and not p.name.startswith("_")
        if (t := _load_task(p, policy, problems)) is not None
    ]
    if not tasks and not problems:
        problems.append(f"{path}: no lm-eval task YAML (a *.yaml with `task:`); see evals/README.md")
    if policy is None or problems:
        return None, problems
    n = sum(t.n_docs for t in tasks)
    need = min_docs(policy)
    if need is not None:
        margin = policy.margin.points(1.0)
        if n < need:
            problems.append(
                f"{policy_path}: {n} documents can never PASS: at margin {margin:g} and confidence "
                f"{policy.confidence:g} even identical builds need at least {need}; "
                "add documents or widen the margin"
            )
            return None, problems
    return Team(
        name=path.name,
        path=path,
        policy=policy,
        tasks=tuple(tasks),
        digest=digest_tree(path),
        scores_digest=scores_digest(path, tasks),
    ), []


def scores_digest(path: Path, tasks: list[Task]) -> str:
    """One digest over the files lm-eval reads for a team: its task YAMLs and their data files
    (by path relative to the team folder and content)."""
    root = path.resolve()
    data = {Path(f) for t in tasks for f in t.config["dataset_kwargs"]["data_files"].values()}
    files = {t.path.resolve() for t in tasks} | data
    return digest_of({f.relative_to(root).as_posix(): sha256_file(f) for f in files})


def load_team(path: Path) -> Team:
    """Load one team folder. Raises QuantgateError listing every problem with file:line."""
    team, problems = inspect_team(path)
    if team is None:
        raise QuantgateError(_listing(path.name, problems))
    return team


def _listing(team: str, problems: list[str]) -> str:
    return f"team {team}: {len(problems)} problem(s):\n  " + "\n  ".join(problems)


def load_teams(root: Path) -> list[Team]:
    """Every team under `root` (folders with a team.yaml), sorted by name.

    Raises QuantgateError listing every problem of every team (each named), if there is no
    team, or if two teams declare the same task name.
    """
    if not root.is_dir():
        raise QuantgateError(f"{root}: not a folder of team eval sets; see evals/README.md")
    folders = [p for p in sorted(root.iterdir()) if (p / POLICY_FILE).is_file()]
    if not folders:
        raise QuantgateError(f"{root}: no team folders (a folder with {POLICY_FILE}); see evals/README.md")
    teams, errors = [], []
    for p in sorted(root.iterdir()):  # task files without a policy would silently drop a team from the gate
        if p.is_dir() and not (p / POLICY_FILE).is_file() and any(p.glob("*.yaml")):
            errors.append(
                _listing(
                    p.name,
                    [
                        f"{p}: has task YAMLs but no {POLICY_FILE}; add one (see "
                        "`quantgate evals new`) or move the folder out of the eval sets"
                    ],
                )
            )
    for folder in folders:
        team, problems = inspect_team(folder)
        if team is None:
            errors.append(_listing(folder.name, problems))
        else:
            teams.append(team)
    seen: dict[str, Path] = {}
    for team in teams:
        for task in team.tasks:
            if task.name in seen:
                errors.append(
                    _listing(
                        team.name,
                        [f"{task.path}: task name {task.name!r} already used by {seen[task.name]}; rename one"],
                    )
                )
            seen[task.name] = task.path
    if errors:
        raise QuantgateError("\n".join(errors))
    return teams
