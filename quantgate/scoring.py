"""Scoring one team's eval set with lm-eval on any lm-eval model (a vLLM client or the in-process hf backend).

Shared by the evaluate stage (through vLLM) and the search stage (in-process screening): one team's
tasks run in the template sandbox, the team metric is read per sample, and prompts lm-eval would
cut are refused.
"""

from __future__ import annotations

import time

from pydantic import Field

from quantgate.errors import QuantgateError
from quantgate.params import Frozen
from quantgate.results import Sample, TaskScore, TeamScores
from quantgate.sandbox import lm_eval_sandboxed
from quantgate.teams import Team


class HarnessParams(Frozen):
    num_concurrent: int = Field(default=2, ge=1)  # parallel HTTP requests to the server
    batch_size: int = Field(default=8, ge=1)  # prompts per request (loglikelihood tasks)
    max_retries: int = Field(default=3, ge=0)
    limit: int | None = Field(default=None, gt=0)  # cap docs per task for every team (smoke runs)
    add_bos_token: bool = False  # SmolLM2's tokenizer adds no BOS; set per model
    seed: int = Field(default=1234, ge=0, le=2**32 - 1)  # lm-eval's np.random.seed takes no other


def effective_limit(team: Team, harness: HarnessParams) -> int | None:
    """The doc cap for a team: the smaller of the team's own limit and the harness limit."""
    limits = [x for x in (team.policy.limit, harness.limit) if x is not None]
    return min(limits) if limits else None


def selected_filter(task_config: dict) -> str:
    """The filter whose output is scored: the task's first `filter_list` entry, else "none"."""
    filters = task_config.get("filter_list") or []
    return filters[0]["name"] if filters else "none"


def per_sample_scores(team: Team, results: dict) -> tuple[dict[str, TaskScore], list[Sample]]:
    """Extract ({task: summary}, [per-sample rows]) for the team metric from lm-eval output.

    Raises QuantgateError if a task has no samples or a score is missing/non-numeric, and
    if the mean of the per-sample scores disagrees with lm-eval's aggregate (a broken log).
    """
    metric = team.policy.metric
    tasks, rows = {}, []
    for task in team.tasks:
        flt = selected_filter(task.config)
        samples = [s for s in results.get("samples", {}).get(task.name, []) if s.get("filter", "none") == flt]
        if not samples:
            raise QuantgateError(f"task {task.name}: lm-eval returned no samples for filter {flt!r}")
        scores = []
        for s in samples:
            value = s.get(metric)
            if not isinstance(value, (int, float)) or value != value:
                raise QuantgateError(
                    f"task {task.name} doc {s.get('doc_id')}: metric {metric!r} is {value!r}, not a number"
                )
            scores.append(float(value))
            rows.append(Sample(task=task.name, doc_id=s["doc_id"], doc_hash=s.get("doc_hash"), score=float(value)))
        mean = sum(scores) / len(scores)
        reported = results["results"][task.name].get(f"{metric},{flt}")
        if isinstance(reported, (int, float)) and abs(reported - mean) > 1e-9:
            raise QuantgateError(f"task {task.name}: per-sample mean {mean} != lm-eval aggregate {reported}")
        tasks[task.name] = TaskScore(filter=flt, n=len(scores), score=mean)
    return tasks, rows


def check_scored(team: Team, results: dict, limit: int | None, docs: dict[str, list[int]] | None = None) -> None:
    """Raises QuantgateError unless lm-eval scored exactly the tasks validate listed for `team` (quantgate/teams.py,
    the same rules as `quantgate evals validate`), each on as many documents as validate counted (Task.n_docs,
    after the team's limit) capped at `limit` (effective_limit), or on exactly the documents `docs` names (a share
    of the team, {task: doc indices}, quantgate/sharding.py). lm-eval keeps one of two tasks of one name,
    and a loader that read the data differently would change the counts: either way the team's verdict would
    rest on documents nobody checked, so it fails closed."""
    listed = {t.name: t for t in team.tasks}
    samples = results.get("samples") or {}
    if set(samples) != set(listed):
        raise QuantgateError(
            f"lm-eval scored tasks {sorted(samples)}, but validate listed {sorted(listed)}; "
            "run `quantgate evals validate` on the team's folder"
        )
    for name, task in listed.items():
        flt = selected_filter(task.config)
        scored = [s.get("doc_id") for s in samples[name] if s.get("filter", "none") == flt]
        n = len(scored)
        want = min(task.n_docs, limit) if limit else task.n_docs
        if docs is not None:
            want = len(docs[name])
            if sorted(scored) != sorted(docs[name]):
                raise QuantgateError(f"task {name}: lm-eval scored other documents than the share it was given")
        if n != want:
            raise QuantgateError(
                f"task {name}: lm-eval scored {n} documents, but validate counted {want} in "
                f"{task.config['dataset_kwargs']['data_files'].get(task.config.get('test_split') or '', '')}; "
                "run `quantgate evals validate` on the team's folder"
            )


def over_length(raw: list[dict], encode, max_length: int, default_gen_toks: int = 256) -> list[str]:
    """Requests lm-eval would left-truncate, one line each ("task doc N: ...").

    `raw` are lm-eval's logged samples (with `task`); `encode` the client's tokenizer (str ->
    token ids); `max_length` the client's context length in tokens. A loglikelihood request
    (context, continuation) needs len(context) + len(continuation) <= max_length; a generation
    request (context, gen_kwargs) needs len(context) + max_gen_toks <= max_length
    (lm_eval/models/api_models.py and huggingface.py cut the context's start otherwise, silently
    for generation). default_gen_toks = lm-eval's default max_gen_toks (256).
    """
    lines = []
    for s in raw:
        for args in s.get("arguments") or []:
            if len(args) < 2 or not isinstance(args[0], str):
                continue  # loglikelihood_rolling windows long documents by design
            context, other = args[0], args[1]
            if isinstance(other, dict):
                need, what = other.get("max_gen_toks") or default_gen_toks, "to generate"
            elif isinstance(other, str):
                need, what = len(encode(other)), "of an answer choice"
            else:
                continue
            if (n := len(encode(context))) + need > max_length:
                lines.append(
                    f"{s.get('task')} doc {s.get('doc_id')}: prompt is {n} tokens + {need} {what} > {max_length}"
                )
                break
    return lines


def run_team(
    lm, team: Team, harness: HarnessParams, docs: dict[str, list[int]] | None = None
) -> tuple[TeamScores, list[dict]]:
    """Run lm-eval on one team's tasks, or on the documents `docs` names ({task: doc indices}, a share of the
    team scored on one of several servers: quantgate/sharding.py); return (its scores, lm-eval's raw samples).

    Team tasks are whole inline configs (no `include:`, quantgate/checks.py), so lm-eval's index
    of its ~14,700 built-in tasks is not built: that index costs ~14 s per call on a 2-core CPU.
    lm-eval renders the team's templates in the sandbox (quantgate/sandbox.py lm_eval_sandboxed).
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    started = time.monotonic()
    with lm_eval_sandboxed():  # the team's templates are rendered in the sandbox (quantgate/sandbox.py)
        results = simple_evaluate(
            model=lm,
            tasks=[t.config for t in team.tasks],
            task_manager=TaskManager(include_defaults=False),
            limit=None if docs is not None else effective_limit(team, harness),
            samples=docs,  # lm-eval scores exactly these documents of each task (it refuses a limit beside them)
            log_samples=True,
            apply_chat_template=team.policy.chat_template,
            cache_requests=False,
            random_seed=harness.seed,
            numpy_random_seed=harness.seed,
            torch_random_seed=harness.seed,
            fewshot_random_seed=harness.seed,
        )
    if results is None:
        raise QuantgateError("lm-eval returned no results")
    check_scored(team, results, effective_limit(team, harness), docs)
    tasks, rows = per_sample_scores(team, results)
    raw = [dict(s, task=name) for name, samples in results["samples"].items() for s in samples]
    gen_toks = getattr(lm, "max_gen_toks", None) or getattr(lm, "_max_gen_toks", 256)
    if over := over_length(raw, lm.tok_encode, lm.max_length, gen_toks):  # scores of cut prompts measure
        raise QuantgateError(  # something the team did not write
            f"{len(over)} prompt(s) longer than the model's context, which lm-eval would cut: {over[0]}"
            f"{f' (and {len(over) - 1} more)' if len(over) > 1 else ''}; shorten those documents or raise "
            f"evaluate.serve.max_model_len"
        )
    scores = TeamScores(
        status="ok",
        metric=team.policy.metric,
        tasks=tasks,
        samples=rows,
        elapsed_s=round(time.monotonic() - started, 1),
    )
    return scores, raw
