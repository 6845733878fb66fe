"""What a team's eval set costs every build, estimated before any model exists, and the budget it must fit.

validate runs before `prepare`, so there is no tokenizer yet: prompt tokens are counted as characters of the
rendered requests divided by CHARS_PER_TOKEN. Per scored document (after the team's `limit:`):
- prompt characters: the description, `num_fewshot` few-shot examples (each its rendered text, target
  delimiter, answer and few-shot delimiter; the mean over the few-shot file), the rendered doc_to_text and
  the target delimiter, once per request: a multiple_choice document is one request per choice (each with
  that choice appended), a generation document one request. A chat template's own tokens are not counted.
- generated tokens at most: a generation document's `max_gen_toks` (lm-eval's default 256 when unset);
  loglikelihood requests generate none.

The budget is params.yaml `validate.budget` (per team, per build), with a per-team override in
`validate.teams.<team>` that the release side sets (a team's own folder cannot raise its budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from quantgate.errors import QuantgateError
from quantgate.params import PARAMS_FILE, Frozen, load_block, read_yaml, where

# Characters per token of the estimate. SmolLM2's tokenizer (the builtin model) reads the shipped sets' rendered
# prompts at 2.7 (billing: arithmetic, a digit a token), 4.1 (search) and 4.7 (support) characters per token
# (measured 2026-12-03); 2.5 counts more tokens than any of them, so a set the estimate lets through is not
# larger on the server.
CHARS_PER_TOKEN = 2.5
LM_EVAL_MAX_GEN_TOKS = 256  # lm-eval's default max_gen_toks (lm_eval/api/model.py, TemplateLM)


class Budget(Frozen):
    """What one team's set may cost per build (every build is scored on it)."""

    documents: int = Field(default=4000, gt=0)  # scored documents, all tasks, after the team's limit
    prompt_tokens: int = Field(default=1_000_000, gt=0)  # estimated prompt tokens sent to the server
    generated_tokens: int = Field(default=100_000, gt=0)  # most tokens the server may generate


class BudgetOverride(Frozen):
    """A team's own budget (validate.teams.<team>); a field left out keeps validate.budget's."""

    documents: int | None = Field(default=None, gt=0)
    prompt_tokens: int | None = Field(default=None, gt=0)
    generated_tokens: int | None = Field(default=None, gt=0)


class ValidateParams(Frozen):
    """params.yaml `validate`: the cost budget of every team, and the teams the release side gave their own."""

    budget: Budget = Budget()
    teams: dict[str, BudgetOverride] = {}

    def for_team(self, team: str) -> Budget:
        """The budget of `team`: validate.budget, with validate.teams.<team>'s fields over it."""
        override = self.teams.get(team)
        if override is None:
            return self.budget
        return self.budget.model_copy(update=override.model_dump(exclude_none=True))

    def source(self, team: str, what: str) -> str:
        """The params.yaml key that sets `team`'s budget for `what` ("documents", "prompt tokens" or
        "generated tokens", as `over` names them): validate.teams.<team>.<field> where the release side
        gave the team its own, else validate.budget.<field>."""
        field = what.replace(" ", "_")
        override = self.teams.get(team)
        if override is not None and getattr(override, field) is not None:
            return f"validate.teams.{team}.{field}"
        return f"validate.budget.{field}"


@dataclass(frozen=True)
class DocCost:
    """One scored document's share: prompt characters sent, and tokens the server may generate."""

    prompt_chars: int
    generated_tokens: int


@dataclass(frozen=True)
class Cost:
    """A team's estimated cost per build."""

    documents: int
    prompt_tokens: int
    generated_tokens: int

    def line(self) -> str:
        """As validate prints it: "400 docs, ~12,345 prompt tokens, <= 9,600 generated tokens"."""
        return (
            f"{self.documents:,} docs, ~{self.prompt_tokens:,} prompt tokens, "
            f"<= {self.generated_tokens:,} generated tokens"
        )


def _text(value) -> str:
    return value if isinstance(value, str) else "" if value is None else str(value)


def _answer(values: dict, multiple_choice: bool) -> str:
    """The answer text lm-eval appends to a few-shot example: the target, or the choice it indexes."""
    target, choices = values.get("doc_to_target"), values.get("doc_to_choice")
    if multiple_choice and isinstance(target, int) and isinstance(choices, list) and 0 <= target < len(choices):
        return _text(choices[target])
    return _text(target)


def doc_costs(config: dict, scored: list[dict | None], examples: list[dict | None]) -> list[DocCost]:
    """DocCost of each scored document of a task, from what its templates render (checks.check_data: `scored`
    are the scored split's documents as rendered, `examples` the few-shot split's, [] when it has none)."""
    mc = config.get("output_type") == "multiple_choice"
    target_delim = _text(config.get("target_delimiter", " "))
    shot_delim = _text(config.get("fewshot_delimiter", "\n\n"))
    shots = config.get("num_fewshot") if isinstance(config.get("num_fewshot"), int) else 0
    rendered = [
        len(_text(v.get("doc_to_text"))) + len(target_delim) + len(_answer(v, mc)) + len(shot_delim)
        for v in examples
        if v
    ]
    context = len(_text(config.get("description"))) + (shots * sum(rendered) // len(rendered) if rendered else 0)
    gen = config.get("generation_kwargs") if isinstance(config.get("generation_kwargs"), dict) else {}
    max_gen = gen.get("max_gen_toks") or LM_EVAL_MAX_GEN_TOKS
    out = []
    for values in scored:
        values = values or {}
        prompt = context + len(_text(values.get("doc_to_text"))) + len(target_delim)
        if mc:
            choices = values.get("doc_to_choice") if isinstance(values.get("doc_to_choice"), list) else []
            out.append(DocCost(prompt * len(choices) + sum(len(_text(c)) for c in choices), 0))
        elif config.get("output_type", "generate_until") == "generate_until":
            out.append(DocCost(prompt, max_gen))
        else:  # loglikelihood: the prompt and its target, scored, nothing generated
            out.append(DocCost(prompt + len(_text(values.get("doc_to_target"))), 0))
    return out


def estimate(tasks: list[list[DocCost]], limit: int | None) -> Cost:
    """A team's Cost per build: the first `limit` documents of each task (all with None), tokens rounded up."""
    taken = [costs[:limit] if limit else costs for costs in tasks]
    chars = sum(c.prompt_chars for costs in taken for c in costs)
    return Cost(
        documents=sum(len(costs) for costs in taken),
        prompt_tokens=math.ceil(chars / CHARS_PER_TOKEN),
        generated_tokens=sum(c.generated_tokens for costs in taken for c in costs),
    )


def over(cost: Cost, budget: Budget) -> list[tuple[str, int, int]]:
    """(what, count, budget) of each count of `cost` over `budget`."""
    pairs = [
        ("documents", cost.documents, budget.documents),
        ("prompt tokens", cost.prompt_tokens, budget.prompt_tokens),
        ("generated tokens", cost.generated_tokens, budget.generated_tokens),
    ]
    return [(what, n, most) for what, n, most in pairs if n > most]


def largest_limit(tasks: list[list[DocCost]], budget: Budget) -> int | None:
    """The largest `limit:` (documents per task) with which the team fits `budget`; None if not even 1 does."""
    lo, hi = 0, max((len(c) for c in tasks), default=0)  # fits(lo) holds or lo == 0; fits(hi) does not
    if not over(estimate(tasks, 1), budget):
        lo = 1
    else:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if over(estimate(tasks, mid), budget):
            hi = mid
        else:
            lo = mid
    return lo


def load_budgets(path: Path = PARAMS_FILE, required: bool = True) -> ValidateParams:
    """params.yaml `validate` as ValidateParams. With required=False (a team checking its folder outside the
    project folder, or with an older params.yaml) a missing file or block gives the defaults. Raises
    QuantgateError (file:line) on a wrong field."""
    if not required and not has_validate_block(path):
        return ValidateParams()
    return load_block("validate", ValidateParams, path)


def has_validate_block(path: Path) -> bool:
    """Whether `path` is a params file with a `validate` block (load_budgets(required=False) else gives the
    defaults)."""
    return path.is_file() and "validate" in (read_yaml(path) or {})


def budget_source(path: Path = PARAMS_FILE) -> str:
    """Which budget `load_budgets(path, required=False)` read, for the user: a team checking its folder outside
    the project folder gets the defaults, which `dvc repro` may not use."""
    if has_validate_block(path):
        return f"{path.resolve()} `validate` (validate.budget, validate.teams)"
    return (
        f"the defaults (no {path.name} with a `validate` block in {Path.cwd()}); run this in the project folder "
        "to check against the budget `dvc repro` uses"
    )


def check_budget_teams(params: ValidateParams, teams: list[str], path: Path = PARAMS_FILE) -> None:
    """Raises QuantgateError (params.yaml line) for a validate.teams key that is no team: a typo would leave
    that team on the default budget."""
    for team in params.teams:
        if team not in teams:
            at = where(path, f"validate.teams.{team}")
            raise QuantgateError(
                f"{at}: validate.teams.{team}: not a team under evals/ (teams: {', '.join(teams)}); "
                "fix the name or drop it"
            )
