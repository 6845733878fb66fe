"""Load team eval sets from evals/<team>/ into typed objects.

A team folder holds `team.yaml` (the gate policy) and one or more standard lm-eval task
YAMLs (every other *.yaml must be one) whose `dataset_kwargs.data_files` name JSONL
files relative to the folder. Files starting with "_" are shared templates, not tasks.
"""

from __future__ import annotations

import copy
import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from quantgate.budget import Cost, DocCost, ValidateParams, doc_costs, estimate, largest_limit, over
from quantgate.checks import BINARY_METRICS, check_data, check_filters, check_metrics, check_task, min_docs_to_pass
from quantgate.console import shown
from quantgate.errors import QuantgateError
from quantgate.fewshot import check_examples, scored_split
from quantgate.hashing import digest_of, digest_tree, sha256_file
from quantgate.params import Frozen, key_lines, parse, read_yaml
from quantgate.taskdata import capped, data_files, read_rows
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


MAX_PERSON = 250  # characters of an owner or contact: a name or address, bounded as --by is (registry.approval)


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

    @field_validator("owner", "contact")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        value = plain_spaces(value)
        if not any(ch.isprintable() and not ch.isspace() for ch in value):  # notices would go to nobody
            raise ValueError("is blank; name who owns the set and who to tell when the gate fails")
        if not value.isprintable():  # a newline would print as two lines of validate's report
            raise ValueError("must be one line of printable characters (no newline or tab)")
        if len(value) > MAX_PERSON:  # printed in validate's report and every gate notice
            raise ValueError(f"is {len(value)} characters; at most {MAX_PERSON}: give a team's name or an address")
        return value


def plain_spaces(value: str) -> str:
    """`value` with each Unicode space (a no-break space U+00A0, a thin space, ...) made a plain space: an owner or
    contact is display text (validate's report, results/teams.json), which str.isprintable() would refuse for one."""
    return "".join(" " if unicodedata.category(ch) == "Zs" else ch for ch in value)


@dataclass(frozen=True)
class Task:
    """One lm-eval task: `config` is the task YAML with data paths made absolute; `docs` the scored split's
    documents as lm-eval's datasets loader returns them (quantgate/loader.py), all of them, in file order;
    `costs` each one's share of the team's cost per build (quantgate/budget.py); `renders` (line, what the
    templates render under the task's scoring settings) of each scored document (after the team's limit), for
    the rule that no two tasks of a team score the same document (_repeats_across)."""

    name: str
    path: Path
    config: dict
    n_docs: int  # documents the gate will see (test split, after the team's limit)
    docs: tuple[dict, ...] = ()
    costs: tuple[DocCost, ...] = ()
    renders: tuple[tuple[int, str], ...] = ()


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

    @property
    def cost(self) -> Cost:
        """The estimated cost of scoring this team's set once (per build), after its limit (quantgate/budget.py)."""
        return estimate([list(t.costs) for t in self.tasks], self.policy.limit)


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


def _not_a_task(path: Path, config: object) -> str | None:
    """Why the YAML `config` read from the task file `path` is not one lm-eval task (a mapping whose `task:` is its
    name), or None: an empty file, another kind of value, an lm-eval group (`group:`, a `task:` list: lm-eval 0.4.13
    reads any YAML with `group:` as one), a `task:` that is not a name (shown only when short)."""
    if config is None:
        return (
            f"{path}: holds no task (no YAML in it, comments only, or null); a task YAML is a mapping (task:, "
            "dataset_path:, ...): write the task in it, or delete the file"
        )
    if not isinstance(config, dict):
        return (
            f"{path}: a task YAML must be a mapping (task:, dataset_path:, ...), got a {type(config).__name__}; "
            "name shared templates with a leading _"
        )
    task = config.get("task")
    if "group" in config or isinstance(task, list):
        return (
            f"{key_locator(path)('group' if 'group' in config else 'task')}: an lm-eval group (lm-eval reads a YAML "
            "with `group:`, or a `task:` list, as one) is not supported here: one task per YAML; write each task in "
            "a YAML of its own, with "
            "`task: <its name>`"
        )
    if not isinstance(task, str):
        shown_task = repr(task) if len(repr(task)) <= 60 else f"a {type(task).__name__}"
        return (
            f"{key_locator(path)('task')}: `task:` must be the task's name (a string), got {shown_task}; name shared "
            "templates with a leading _"
        )
    return None


def _load_task(path: Path, policy: TeamPolicy | None, problems: list[str]) -> Task | None:
    """One task YAML, data paths made absolute; appends every problem found to `problems`."""
    if path.is_symlink():  # its digest and the sandbox's checks cover only the folder's own files
        problems.append(
            f"{path}: is a symlink (to {path.readlink()}); a task YAML must be a regular file in the team folder: "
            "copy it in"
        )
        return None
    try:
        config = read_yaml(path)
    except QuantgateError as exc:
        problems.append(str(exc))
        return None
    if _size(config) > MAX_NODES:
        problems.append(f"{path}: expands to over {MAX_NODES} YAML values (aliases of aliases?); write it out plainly")
        return None
    if (why := _not_a_task(path, config)) is not None:
        problems.append(why)
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
            f"{where('dataset_kwargs')}: dataset_kwargs.data_files must map a split to a JSONL file in this folder, "
            "e.g. {test: data.jsonl}"
        )
        return None
    split = scored_split(config)
    if split is None:  # a split that is set but not a data_files key is check_task's (SPLIT_KEYS)
        problems.append(
            f"{where('dataset_kwargs')}: no test_split (nor validation_split): set test_split to the key of "
            f"dataset_kwargs.data_files lm-eval scores, one of {sorted(files)}"
        )
    resolved = data_files(path, files, where, problems)
    if resolved is None:
        return None
    refused: set[str] = set()
    rows = read_rows(resolved, where, problems, refused)
    if rows is None:
        return None
    rendered, clean = {}, True
    for name, file in resolved.items():
        scored = (policy.limit if policy is not None else None) if name == split else 0  # None: every row
        found, rendered[name] = check_data(
            config, file, rows[name], where, render=not unsafe, scored=scored, refused=name in refused
        )
        problems += capped(file, found)
        clean = clean and not found
    found, examples = check_examples(where, config, resolved, rows, rendered, compare=clean)
    problems += found
    scored = rows.get(split, [])
    config["dataset_kwargs"]["data_files"] = {name: str(f) for name, f in resolved.items()}
    n_docs = len(scored) if policy is None or not policy.limit else min(len(scored), policy.limit)
    costs = doc_costs(config, [v for v, _ in rendered.get(split, [])], examples)
    metric = policy.metric if policy is not None else None
    settings = json.dumps(_scoring_settings(config, split, metric), sort_keys=True, ensure_ascii=False, default=str)
    renders = [  # the settings once per task, not once per document: one key is settings + a document's renders
        (n, settings + "\n" + json.dumps(main, sort_keys=True, ensure_ascii=False, default=str))
        for (n, _, _), (main, _) in zip(scored[:n_docs], rendered.get(split, []), strict=False)
        if main
    ]
    return Task(
        name=str(config["task"]),
        path=path,
        config=config,
        n_docs=n_docs,
        docs=tuple(doc for _, _, doc in scored),
        costs=tuple(costs),
        renders=tuple(renders),
    )


# task keys that name a task or its scored file, not how a document is scored
_NAMING_KEYS = ("task", "task_alias", "tag", "metadata", "dataset_name", "test_split", "validation_split")


def _scoring_settings(config: dict, split: str | None, metric: str | None) -> dict:
    """The task YAML `config` without what only names it or its scored split's file (`split`): two tasks with the
    same settings score a document that renders the same alike. The few-shot files stay, by content (they change
    the prompt; a copy under another name does not); of `metric_list`, only the entries of the gate's `metric` (the
    team's) stay: the gate reads no other metric, so a copy that adds one scores each document alike too."""
    settings = {k: v for k, v in config.items() if k not in _NAMING_KEYS}
    if metric is not None and isinstance(settings.get("metric_list"), list):
        settings["metric_list"] = [
            m for m in settings["metric_list"] if isinstance(m, dict) and m.get("metric") == metric
        ]
    files = {k: sha256_file(Path(v)) for k, v in config["dataset_kwargs"]["data_files"].items() if k != split}
    return {**settings, "dataset_kwargs": {"data_files": files}}


def _repeats_across(tasks: list[Task]) -> list[str]:
    """A scored document that a task renders as an earlier task of the team does, with the same settings (the same
    data file read by two copies of a task, or a copy of it): the gate pools every task's documents in one paired
    test, where that document would count twice, as if it were two pieces of evidence."""
    problems, seen = [], {}
    for t in (t for t in tasks if t.renders):  # none for a task without a scored split: that is its own problem
        file = Path(t.config["dataset_kwargs"]["data_files"][scored_split(t.config)])
        found = []
        for n, key in t.renders:
            task, other, line = seen.setdefault(key, (t.name, file, n))
            if task != t.name:
                at = f"line {line}" if other == file else f"{other}:{line}"
                found.append(
                    f"{file}:{n}: renders in task {t.name!r} the same prompt and answer, with the same settings, as "
                    f"{at} in task {task!r}, so the gate would count one document twice; remove the repeat or one "
                    "of the two tasks"
                )
        problems += capped(file, found)
    return problems


def min_docs(policy: TeamPolicy) -> int | None:
    """Fewest documents with which identical builds can PASS under `policy` (0/1 metrics;
    None for continuous ones). A relative margin is taken at its widest, on a perfect score of 1."""
    if policy.metric not in BINARY_METRICS:
        return None
    return min_docs_to_pass(policy.margin.points(1.0), policy.confidence)


# also an MLflow tag key part (gate.<team>.verdict); use fullmatch: `$` also matched before a trailing newline
TEAM_NAME = re.compile(r"[a-z][a-z0-9_]{1,39}")
TEAM_NAME_RULE = "use lower_snake_case, 2-40 characters, starting with a letter (it names the team in tags and reports)"


def inspect_team(
    path: Path, taken: dict[str, Path] | None = None, budgets: ValidateParams | None = None
) -> tuple[Team | None, list[str]]:
    """Load one team folder and collect every problem; the Team is None if it cannot be built.

    `taken`: task names other teams' folders declare, {name: task file} (declared_tasks); a task of this team
    with one of them is a problem, as is a name two of its own task files give. `budgets`: what the sets may
    cost per build (quantgate/budget.py: this team's, and the params.yaml key that set it); None checks no
    budget.
    """
    policy_path = path / POLICY_FILE
    problems: list[str] = []
    if not TEAM_NAME.fullmatch(path.name):
        problems.append(f"{path}: team folder name {path.name!r}: {TEAM_NAME_RULE}")
    if path.is_symlink():  # git keeps the link, not the files: a fresh clone would not have this team's sets
        problems.append(
            f"{path}: is a symlink (to {path.readlink()}); a team folder must be a folder itself, committed with "
            "its files (git keeps a link, not what it points to): copy it in"
        )
    policy = None
    if policy_path.is_symlink():
        problems.append(
            f"{policy_path}: is a symlink (to {policy_path.readlink()}); team.yaml must be a regular file in the "
            "team folder: copy it in"
        )
    else:
        try:
            policy = parse(TeamPolicy, read_yaml(policy_path), str(policy_path), policy_path)
        except QuantgateError as exc:
            problems.append(str(exc))
    problems += [
        f"{p}: a second policy file beside {POLICY_FILE}; delete the one you do not mean"
        if p.name == "team.yml"
        else f"{p}: task files end in .yaml, and this one would not be scored; rename it {p.with_suffix('.yaml').name}"
        for p in sorted(path.iterdir())
        if _yaml_named(p) and p.suffix != ".yaml" and not p.name.startswith(("_", ".")) and not p.is_dir()
    ]
    problems += [
        f"{p}: task files are read from the team folder itself, and this one in a subfolder would not be scored; "
        f"move it to {path}/ (or name it with a leading _ if it is not a task)"
        for p in sorted(q for pattern in ("*/**/*.yaml", "*/**/*.yml") for q in path.glob(pattern))
        if not p.name.startswith(("_", ".")) and not any(part.startswith(".") for part in p.relative_to(path).parts)
    ]
    tasks = [t for p in task_files(path) if (t := _load_task(p, policy, problems)) is not None]
    problems += _name_clashes(tasks, taken or {})
    problems += _repeats_across(tasks)
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
                f"{policy_path}:{key_lines(policy_path).get(('margin',), 1)}: {n} documents can never PASS: at "
                f"margin {margin:g} and confidence "
                f"{policy.confidence:g} even identical builds need at least {need}; "
                "add documents or widen the margin"
            )
            return None, problems
    team = Team(
        name=path.name,
        path=path,
        policy=policy,
        tasks=tuple(tasks),
        digest=digest_tree(path),
        scores_digest=scores_digest(path, tasks),
    )
    if budgets is not None and (found := _over_budget(team, budgets)):
        return None, found
    return team, []


def _unread_team(path: Path) -> str | None:
    """Why the folder `path` under the eval sets looks like a team that would not be read (and so not gated), or
    None: a folder (not hidden, not _shared) without a regular team.yaml that holds a team.yml, a team.yaml that
    is no file, or task or data files (*.yaml, *.yml, *.jsonl, in any case)."""
    if not path.is_dir() or path.name.startswith(("_", ".")) or (path / POLICY_FILE).is_file():
        return None
    if (path / "team.yml").exists():
        return f"{path / 'team.yml'}: the policy file is {POLICY_FILE}; rename it, or this team is not gated"
    if (path / POLICY_FILE).exists():
        return f"{path / POLICY_FILE}: not a file; a team's policy is a YAML file (see `quantgate evals new`)"
    if any(_task_or_data_named(p) for p in path.iterdir()):
        return (
            f"{path}: has task or data files but no {POLICY_FILE}; add one (see `quantgate evals new`) or move the "
            "folder out of the eval sets"
        )
    return None


def _stray_files(root: Path) -> list[str]:
    """Task or data files (*.yaml, *.yml, *.jsonl in any case; not hidden, not _shared) directly in the folder of
    team eval sets `root`: no team reads them, so a set put there would drop out of the gate without a word."""
    return [
        f"{p}: a task or data file beside the team folders is read by no team; move it into its team's folder "
        f"({root / '<team>'}, with a {POLICY_FILE}) or out of the eval sets"
        for p in sorted(root.iterdir())
        if _task_or_data_named(p) and not p.name.startswith(("_", ".")) and not p.is_dir()
    ]


def _yaml_named(path: Path) -> bool:
    """Whether `path`'s name ends as a YAML file's in any case (.yaml, .yml, .YAML): lm-eval reads *.yaml alone, so
    the others are named, not skipped without a word."""
    return path.suffix.lower() in (".yaml", ".yml")


def _task_or_data_named(path: Path) -> bool:
    """Whether `path`'s name ends as a task or data file's in any case (_yaml_named, or .jsonl)."""
    return _yaml_named(path) or path.suffix.lower() == ".jsonl"


def task_files(path: Path) -> list[Path]:
    """A team folder's task YAMLs: every *.yaml but team.yaml, shared templates (a leading _) and hidden files
    (a leading .: an editor's backup, macOS's ._ resource forks, which are not YAML), sorted."""
    return [p for p in sorted(path.glob("*.yaml")) if p.name != POLICY_FILE and not p.name.startswith(("_", "."))]


def declared_tasks(path: Path) -> list[tuple[str, Path]]:
    """(task name, task file) of every task YAML in a team folder that names one, read without checking the
    rest of the file (another team's folder, when one team is checked: its other problems are its own)."""
    out = []
    for p in task_files(path):
        try:
            config = read_yaml(p)
        except QuantgateError:
            continue
        if isinstance(config, dict) and isinstance(config.get("task"), str):
            out.append((config["task"], p))
    return out


def declared_under(root: Path) -> dict[Path, list[tuple[str, Path]]]:
    """{team folder: its declared_tasks} of every folder under `root` that holds a team.yaml (POLICY_FILE), in
    name order: the task names a team's own must not repeat (load_teams; quantgate.scaffold before it writes)."""
    return {folder: declared_tasks(folder) for folder in sorted(root.iterdir()) if (folder / POLICY_FILE).is_file()}


def _name_clashes(tasks: list[Task], taken: dict[str, Path]) -> list[str]:
    """A task name given twice in one team, or one that another team's folder gives (`taken`): lm-eval would
    keep one of the two tasks and score it for both."""
    problems, own = [], {}
    for t in tasks:
        where = key_locator(t.path)("task")
        if t.name in own:
            problems.append(
                f"{where}: task name {t.name!r} already used by {own[t.name]} in this team's folder; rename one"
            )
        elif t.name in taken:
            problems.append(f"{where}: task name {t.name!r} already used by {taken[t.name]}; rename one")
        own.setdefault(t.name, t.path)
    return problems


def _over_budget(team: Team, budgets: ValidateParams) -> list[str]:
    """One line per count of the team's cost over its budget, naming its data files, the count, the budget and
    the params.yaml key that set it (ValidateParams.source), and what to do: the largest `limit:` that fits where that
    still leaves a set that can PASS (min_docs), else what else to change (max_gen_toks, the prompts) or
    whom to ask."""
    cost, budget = team.cost, budgets.for_team(team.name)
    excess = over(cost, budget)
    if not excess:
        return []
    files = ", ".join(shown(Path(t.config["dataset_kwargs"]["data_files"][scored_split(t.config)])) for t in team.tasks)
    policy_file = shown(team.path / POLICY_FILE)
    fits = largest_limit([list(t.costs) for t in team.tasks], budget)
    need = min_docs(team.policy)
    kept = sum(min(fits, t.n_docs) for t in team.tasks) if fits else 0
    lines = []
    for what, count, most in excess:
        key = budgets.source(team.name, what)
        ask = (
            "to raise it"
            if key.startswith("validate.teams.")
            else f"for validate.teams.{team.name}.{key.split('.')[-1]}"
        )
        if fits and (need is None or kept >= need):
            fix = f"evaluate fewer with `limit: {fits}` in {policy_file} (documents per task)"
        elif fits:  # the limit that fits leaves too few documents for identical builds to PASS
            fix = (
                f"no set that can PASS fits: `limit: {fits}` in {policy_file} would score {kept} documents, fewer "
                f"than the {need} its margin needs"
            )
        elif what == "generated tokens":  # max_gen_toks per generation document, whatever the prompt
            fix = "lower generation_kwargs.max_gen_toks in its task YAML"
        elif what == "prompt tokens":
            fix = "shorten the prompts (few-shot examples count in every prompt)"
        else:
            fix = "merge or drop tasks (each scores at least one document)"
        lines.append(
            f"{files}: {count:,} {what} per build (estimated: {cost.line()}) is over the budget of {most:,} "
            f"(params.yaml {key}); {fix}, or ask the release side {ask}"
        )
    return lines


def scores_digest(path: Path, tasks: list[Task]) -> str:
    """One digest over the files lm-eval reads for a team: its task YAMLs and their data files
    (by path relative to the team folder and content)."""
    root = path.resolve()
    data = {Path(f) for t in tasks for f in t.config["dataset_kwargs"]["data_files"].values()}
    files = {t.path.resolve() for t in tasks} | data
    return digest_of({f.relative_to(root).as_posix(): sha256_file(f) for f in files})


def load_team(path: Path, budgets: ValidateParams | None = None) -> Team:
    """One team folder, checked by every rule load_teams applies (its task names against its siblings' under
    path's parent folder included). Raises QuantgateError listing every problem with file:line."""
    path = path if path.name not in ("", ".", "..") else path.resolve()  # `.` has no name to find it by
    return load_teams(path.parent, only=path.name, budgets=budgets)[0]


def teams_beside(path: Path) -> tuple[list[Team], list[str]]:
    """The other team folders beside the team folder `path` (under its parent) that load, for the rules that
    compare one team with the others (a calibration conversation must not quote any team's document), and the
    names of those that do not load (their problems are their own: they are not compared)."""
    path = path if path.name not in ("", ".", "..") else path.resolve()
    loaded, broken = [], []
    for other in sorted(path.parent.iterdir()):
        if other.name == path.name or not (other / POLICY_FILE).is_file():
            continue
        try:
            loaded.append(load_team(other))
        except QuantgateError:
            broken.append(other.name)
    return loaded, broken


def _listing(team: str, problems: list[str]) -> str:
    # a file with many bad lines is listed in part ("<file>: ... and N more", taskdata): count them all
    rest = [int(m.group(1)) for p in problems if (m := re.search(r": \.\.\. and (\d+) more$", p))]
    return f"team {team}: {len(problems) - len(rest) + sum(rest)} problem(s):\n  " + "\n  ".join(problems)


def load_teams(root: Path, only: str | None = None, budgets: ValidateParams | None = None) -> list[Team]:
    """Every team under `root` (folders with a team.yaml), sorted by name; with `only`, that one team folder.

    One set of rules either way: each team is checked (inspect_team) with the task names of every other team
    folder under `root` (declared_tasks) and its budget from `budgets` (None: no budget). Raises QuantgateError
    listing every problem of every team checked (each named), if there is no team, or (checking all) if a
    folder looks like a team that would not be read (task or data files but no team.yaml, a team.yml).
    """
    if not root.is_dir():
        state = "not a folder" if root.exists() else "does not exist"
        raise QuantgateError(f"{root}: {state}; give the folder of team eval sets (evals/); see evals/README.md")
    folders = [p for p in sorted(root.iterdir()) if (p / POLICY_FILE).is_file()]
    if only is not None and not (root / only / POLICY_FILE).is_file():
        why = _unread_team(root / only)
        raise QuantgateError(
            why or f"{root / only}: no {POLICY_FILE}; a team folder has one (see `quantgate evals new`)"
        )
    # task or data files without a policy would drop a team (checking all; `only` has its team.yaml by now)
    unread = (
        [_listing(p.name, [why]) for p in sorted(root.iterdir()) if (why := _unread_team(p))] + _stray_files(root)
        if only is None
        else []
    )
    if not folders:  # `root` may be one team's folder, or hold only teams, that would not be read: say why
        if (root / POLICY_FILE).is_file():  # one team's folder where the folder of teams is read: not "no team"
            raise QuantgateError(
                f"{root}: one team's folder (it has {POLICY_FILE}); give the folder that holds the team folders, "
                f"{root.parent}"
            )
        raise QuantgateError(
            _unread_team(root)
            or "\n".join(unread)
            or f"{root}: no team folders (a folder with {POLICY_FILE}); see evals/README.md"
        )
    teams, errors = [], unread
    declared = declared_under(root)
    for folder in folders if only is None else [root / only]:
        taken = {name: file for other, found in declared.items() if other != folder for name, file in found}
        team, problems = inspect_team(folder, taken, budgets)
        if team is None:
            errors.append(_listing(folder.name, problems))
        else:
            teams.append(team)
    if errors:
        raise QuantgateError("\n".join(errors))
    return teams
