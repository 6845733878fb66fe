"""Checks on a team's task YAML and JSONL data, run without a model.

Every check returns a list of problems, each one line "file[:line]: what is wrong; the fix",
so `quantgate evals validate` can print all of them at once.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from scipy import stats

from quantgate import sandbox
from quantgate.jsonl import BadLine, lines_of, parse_line
from quantgate.templates import RENDERED, check_document, key_locator

MAX_DATA_BYTES = 50 * 1024 * 1024  # a team set larger than this is almost surely a mistake
TEMPLATE_KEYS = ("doc_to_text", "doc_to_target", "doc_to_choice")
# lm-eval per-document metrics that score each document 0 or 1 (lm_eval/api/metrics.py)
BINARY_METRICS = {"acc", "acc_norm", "acc_mutual_info", "exact_match", "acc_all"}


def template_fields(config: dict) -> dict[str, set[str]]:
    """Top-level document fields each template of a task references, {template key: fields}.

    A bare identifier (`doc_to_target: answer`) is a field name, as lm-eval reads it; a string
    with `{{ }}` is a Jinja template whose undeclared variables are fields (less the sandbox's
    globals and the names it refuses, which check_templates reports). Lists (fixed choices) and
    non-strings reference nothing. Raises ValueError on a Jinja syntax error.
    """
    import jinja2
    from jinja2 import meta

    out = {}
    for key in RENDERED:
        t = config.get(key)
        if not isinstance(t, str):
            continue
        if t.strip().isidentifier():
            out[key] = {t.strip()}
        elif "{{" in t or "{%" in t:
            try:
                out[key] = set(meta.find_undeclared_variables(sandbox.ENV.parse(t))) - sandbox.FORBIDDEN_NAMES
            except jinja2.TemplateSyntaxError as exc:
                raise ValueError(f"{key}: template syntax error: {exc.message}") from None
            except RecursionError:
                raise ValueError(f"{key}: template nested too deeply") from None
    return out


def check_metrics(task_path: Path, config: dict, gated_metric: str, higher_is_better: bool) -> list[str]:
    """Problems in a task's `metric_list`: unknown metric or aggregation, gated metric absent,
    not a mean, or with a direction (higher_is_better) that contradicts team.yaml."""
    import lm_eval.api.metrics  # noqa: F401  registers the built-in metrics and aggregations
    from lm_eval.api.registry import AGGREGATION_REGISTRY, HIGHER_IS_BETTER_REGISTRY, METRIC_REGISTRY

    where = key_locator(task_path)
    entries = config.get("metric_list")
    if entries is None or entries == []:
        return [f"{where('metric_list')}: metric_list is missing or empty; list at least the metric team.yaml gates on"]
    if not isinstance(entries, list):
        return [
            f"{where('metric_list')}: metric_list must be a list of {{metric: ..., aggregation: mean}} entries, "
            f"got a {type(entries).__name__}"
        ]
    problems, names = [], []
    for i, m in enumerate(entries):
        if not isinstance(m, dict) or not isinstance(m.get("metric"), str):
            problems.append(f"{where('metric_list', i)}: metric_list[{i}] needs a `metric:` name")
            continue
        names.append(m["metric"])
        if m["metric"] not in METRIC_REGISTRY:
            problems.append(
                f"{where('metric_list', i)}: metric_list[{i}]: unknown metric {m['metric']!r}; "
                f"use one of {sorted(METRIC_REGISTRY)}"
            )
        agg = m.get("aggregation", "mean")
        if not isinstance(agg, str) or agg not in AGGREGATION_REGISTRY:
            problems.append(
                f"{where('metric_list', i)}: metric_list[{i}]: unknown aggregation {agg!r}; "
                f"use one of {sorted(AGGREGATION_REGISTRY)}"
            )
        elif m["metric"] == gated_metric and agg != "mean":
            problems.append(
                f"{where('metric_list', i)}: metric_list[{i}]: the gated metric {gated_metric!r} must aggregate "
                f"with `mean` (the gate pairs per-document scores), not {agg!r}"
            )
        if m["metric"] == gated_metric and "higher_is_better" in m and m["higher_is_better"] != higher_is_better:
            problems.append(
                f"{where('metric_list', i)}: metric_list[{i}]: higher_is_better={m['higher_is_better']} contradicts "
                f"team.yaml higher_is_better={higher_is_better}; make them agree (the gate's direction)"
            )
    output_type = config.get("output_type", "generate_until")
    if (scored := PER_DOC_METRICS.get(output_type)) is not None and gated_metric not in scored:
        problems.append(
            f"{where('output_type')}: output_type {output_type} gives no per-document {gated_metric!r}, the metric "
            "team.yaml gates on"
            + (f" (it gives {', '.join(sorted(scored))})" if scored else "")
            + f"; {PER_DOC_HINT[output_type]}"
        )
    if gated_metric not in names:
        problems.append(
            f"{where('metric_list')}: team.yaml gates on metric {gated_metric!r}, which is not in metric_list {names}"
        )
    if gated_metric in HIGHER_IS_BETTER_REGISTRY and HIGHER_IS_BETTER_REGISTRY[gated_metric] != higher_is_better:
        problems.append(
            f"{where('metric_list')}: team.yaml says higher_is_better: {str(higher_is_better).lower()} for "
            f"{gated_metric!r}, but lm-eval scores {gated_metric} with higher_is_better: "
            f"{str(HIGHER_IS_BETTER_REGISTRY[gated_metric]).lower()}; fix team.yaml (the gate would "
            "count a loss as a gain)"
        )
    return problems


OUTPUT_TYPES = ("multiple_choice", "generate_until", "loglikelihood", "loglikelihood_rolling")
# The 0/1 scores per document that ConfigurableTask.process_results gives for each output type (lm-eval
# 0.4.13, lm_eval/api/task.py), the ones the gate can pair. loglikelihood's perplexity is a log-likelihood per
# document (its aggregation makes it a perplexity), and loglikelihood_rolling's perplexities are
# (log-likelihood, words) pairs weighted over the set: no mean of either is a score.
PER_DOC_METRICS = {
    "multiple_choice": frozenset({"acc", "acc_norm", "acc_bytes", "acc_mutual_info", "exact_match"}),
    "loglikelihood": frozenset({"acc"}),
    "loglikelihood_rolling": frozenset(),
    # generate_until calls each metric on (gold, answer): exact_match returns a score, the rest of the registry's
    # metrics (acc, bleu, f1, ...) pass the pair on to a set-level aggregation
    "generate_until": frozenset({"exact_match"}),
}
PER_DOC_HINT = {
    "multiple_choice": "gate on one of those",
    "loglikelihood": "gate on acc (is the target the greedy continuation) or make it a multiple_choice task",
    "generate_until": "gate on exact_match (with a filter_list that extracts the answer)",
    "loglikelihood_rolling": "its perplexities are weighted over the whole set, not paired per document: "
    "gate a multiple_choice or generate_until task instead",
}
SPLIT_KEYS = ("test_split", "validation_split", "training_split", "fewshot_split")
# lm-eval task keys that take Python callables, load code or prompts from elsewhere, or allow
# running generated code: a team's YAML can only name them, and they are team code either way.
CODE_KEYS = frozenset(
    {"process_docs", "process_results", "custom_dataset", "use_prompt", "unsafe_code", "doc_to_image", "doc_to_audio"}
)


def check_task(task_path: Path, config: dict) -> list[str]:
    """Problems in a task YAML lm-eval would only hit at run time: unknown keys, keys that run
    code (CODE_KEYS, dataset_kwargs beyond data_files), output type, a hub dataset, splits
    without a data file, sampled generation, a bad task name."""
    import dataclasses
    import re

    from lm_eval.api.task import TaskConfig

    problems = []
    where = key_locator(task_path)
    known = {f.name for f in dataclasses.fields(TaskConfig)}
    for key in sorted(set(config) - known):
        problems.append(
            f"{where(key)}: unknown task key {key!r} (lm-eval TaskConfig has no such field)"
            + ("; `include` is not supported: write the task out in full" if key == "include" else "")
        )
    for key in sorted(CODE_KEYS & {k for k, v in config.items() if v not in (None, False)}):
        problems.append(f"{where(key)}: {key}: a team task may not set it (it runs or fetches code); remove it")
    kwargs = config.get("dataset_kwargs")
    for key in sorted(set(kwargs) - {"data_files"} if isinstance(kwargs, dict) else []):
        problems.append(
            f"{where('dataset_kwargs', key)}: dataset_kwargs.{key}: only data_files may be given (the "
            "rest reaches the dataset loader); remove it"
        )
    if config.get("output_type", "generate_until") not in OUTPUT_TYPES:
        problems.append(
            f"{where('output_type')}: output_type {config.get('output_type')!r} is not one of {list(OUTPUT_TYPES)}"
        )
    if config.get("dataset_path") != "json":
        problems.append(
            f"{where('dataset_path')}: dataset_path must be `json` (data come from this folder, never from a hub), "
            f"got {config.get('dataset_path')!r}"
        )
    if not re.fullmatch(r"[A-Za-z0-9_\-.]+", str(config.get("task", ""))):
        problems.append(f"{where('task')}: task name {config.get('task')!r}: use letters, digits, _ - . only")
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    for key in SPLIT_KEYS:
        split = config.get(key)
        if split is not None and isinstance(files, dict) and split not in files:
            problems.append(f"{where(key)}: {key} {split!r} is not a key of dataset_kwargs.data_files {sorted(files)}")
    gen = config.get("generation_kwargs") or {}
    if (
        config.get("output_type") == "generate_until"
        and isinstance(gen, dict)
        and (gen.get("do_sample") or gen.get("temperature", 0) not in (0, 0.0))
    ):
        problems.append(
            f"{where('generation_kwargs')}: generation must be greedy (do_sample: false, temperature: 0): "
            "sampled outputs would compare builds by chance"
        )
    if not isinstance(gen, dict):
        problems.append(f"{where('generation_kwargs')}: generation_kwargs must be a mapping ({', '.join(GEN_KEYS)})")
    elif config.get("output_type", "generate_until") == "generate_until":
        until = gen.get("until")
        if isinstance(until, str) and until:  # one stop string, not a list: say that, not that none was given
            problems.append(
                f"{where('generation_kwargs')}: generation_kwargs.until must be a list of stop strings, got the "
                f"string {until!r}; write it as a list: until: {json.dumps([until], ensure_ascii=False)}"
            )
        elif not (isinstance(until, list) and until and all(isinstance(u, str) and u for u in until)):
            problems.append(
                f"{where('generation_kwargs')}: a generation task "
                f'needs explicit stop strings, generation_kwargs.until (e.g. until: ["\\n\\n"]), got {until!r}: '
                "else where an answer ends is left to each server's defaults"
            )
    for key in sorted(set(gen) - set(GEN_KEYS) if isinstance(gen, dict) else []):
        problems.append(
            f"{where('generation_kwargs', key)}: generation_kwargs.{key}: not allowed (it reaches the "
            f"server as is); use only {', '.join(GEN_KEYS)}"
        )
    toks = gen.get("max_gen_toks") if isinstance(gen, dict) else None
    if toks is not None and (not isinstance(toks, int) or isinstance(toks, bool) or not 1 <= toks <= MAX_GEN_TOKS):
        problems.append(
            f"{where('generation_kwargs', 'max_gen_toks')}: max_gen_toks must be an integer in "
            f"1..{MAX_GEN_TOKS}, got {toks!r}"
        )
    if config.get("repeats", 1) != 1:
        problems.append(
            f"{where('repeats')}: repeats must be 1 (greedy scoring gives the same answer every time; "
            f"repeats multiply the cost for every build), got {config['repeats']!r}"
        )
    if config.get("doc_to_text") is None:
        problems.append(
            f"{where('task')}: doc_to_text is missing: give the prompt template (e.g. "
            '"Question: {{question}}\\nAnswer:"); lm-eval builds every prompt from it'
        )
    fewshot = config.get("fewshot_config") if isinstance(config.get("fewshot_config"), dict) else {}
    for at, block in (((), config), (("fewshot_config",), fewshot)):
        for key, joins in (("target_delimiter", "a prompt and its answer"), ("fewshot_delimiter", "few-shot examples")):
            if key in block and not isinstance(block[key], str):
                value = block[key]
                problems.append(
                    f"{where(*at, key)}: {'.'.join((*at, key))} must be text (lm-eval puts it between {joins}), got "
                    f"{type(value).__name__} {value!r}; "
                    + ("remove the key for lm-eval's default" if value is None else "quote it")
                )
    if isinstance(config.get("doc_to_choice"), list) and len(config["doc_to_choice"]) < 2:
        problems.append(
            f"{where('doc_to_choice')}: doc_to_choice lists {len(config['doc_to_choice'])} choice(s): every build "
            "would score the one right; give 2 or more"
        )
    for key in TEMPLATE_KEYS + ("description", "gen_prefix"):
        value = config.get(key)
        ok = (str, list) if key == "doc_to_choice" else (str, int) if key == "doc_to_target" else (str,)
        if value is not None and (not isinstance(value, ok) or isinstance(value, bool)):
            problems.append(
                f"{where(key)}: {key} must be a template string"
                + (
                    " (or a list of choices)"
                    if key == "doc_to_choice"
                    else " (or a fixed index)"
                    if key == "doc_to_target"
                    else ""
                )
                + f", got {type(value).__name__}"
            )
    problems += _check_fewshot(where, config)
    return problems


GEN_KEYS = ("until", "max_gen_toks", "do_sample", "temperature")  # greedy generation needs no more
MAX_GEN_TOKS = 2048  # tokens; the served context bounds prompt + answer anyway (evaluate checks it)
FEWSHOT_KEYS = (
    "sampler",
    "split",
    "doc_to_text",
    "doc_to_target",
    "doc_to_choice",
    "fewshot_delimiter",
    "target_delimiter",
)


MAX_FEWSHOT = 64  # examples per prompt; more would not fit the context of the models served here


def _check_fewshot(where: Callable[..., str], config: dict) -> list[str]:
    """Problems in a task's few-shot settings: num_fewshot not a whole number in [0, MAX_FEWSHOT] (more
    than the few-shot split holds is checked where the data are read, quantgate/teams.py), fewshot_config
    keys beyond FEWSHOT_KEYS (inline `samples` included: few-shot examples come from a data file, named by
    fewshot_split, where validation renders them), a sampler lm-eval does not have, a template that is not
    a string."""
    from lm_eval.api.samplers import SAMPLER_REGISTRY

    problems = []
    if "num_fewshot" in config:
        n = config["num_fewshot"]
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_FEWSHOT:
            problems.append(
                f"{where('num_fewshot')}: num_fewshot must be a whole number from 0 to {MAX_FEWSHOT}; got {n!r}"
            )
    fewshot = config.get("fewshot_config")
    if fewshot is None:
        return problems
    if not isinstance(fewshot, dict):
        return problems + [f"{where('fewshot_config')}: fewshot_config must be a mapping ({', '.join(FEWSHOT_KEYS)})"]
    problems += [
        f"{where('fewshot_config', key)}: fewshot_config.{key}: not allowed"
        + (
            "; put few-shot examples in a data file and name its split in fewshot_split"
            if key == "samples"
            else f"; use only {', '.join(FEWSHOT_KEYS)}"
        )
        for key in sorted(set(fewshot) - set(FEWSHOT_KEYS))
    ]
    sampler = fewshot.get("sampler", "default")
    if sampler not in SAMPLER_REGISTRY:
        problems.append(
            f"{where('fewshot_config', 'sampler')}: fewshot_config.sampler {sampler!r} is not one of "
            f"lm-eval's samplers {sorted(SAMPLER_REGISTRY)}"
        )
    for key in ("doc_to_text", "doc_to_target", "doc_to_choice"):
        if key in fewshot and not isinstance(fewshot[key], (str, list) if key == "doc_to_choice" else str):
            problems.append(f"{where('fewshot_config', key)}: fewshot_config.{key} must be a template string")
    return problems


def read_docs(data_path: Path) -> tuple[list[str], list[tuple[int, dict]], list[str]]:
    """(problems, [(line, document as written)], the file's lines) of one JSONL data file, every bad line listed.

    These are quantgate's own rules, each stricter than the datasets loader that lm-eval reads the file with
    (quantgate/loader.py) and named in its message: the size rule, the blank-line rule, one JSON object per
    line, and the JSONL rules of quantgate/jsonl.py (UTF-8, no NaN, nesting, unpaired surrogates, a key
    given twice). A leading byte-order mark and CRLF line ends are accepted, as the loader accepts them; CR-only
    line ends (old Mac style), which the loader reads too, are refused (jsonl.lines_of: they would read as one line).
    """
    raw = data_path.read_bytes()
    if len(raw) > MAX_DATA_BYTES:
        return (
            [
                f"{data_path}: {len(raw)} bytes is over the {MAX_DATA_BYTES} byte limit (quantgate's size rule); "
                "split or sample the set"
            ],
            [],
            [],
        )
    try:
        lines = lines_of(raw, loader=True)  # lm-eval reads this file
    except BadLine as exc:
        return [exc.at(data_path)], [], []
    problems, docs = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            if n < len(lines):  # a final newline is fine
                problems.append(f"{data_path}:{n}: blank line (quantgate's blank-line rule); remove it")
            continue
        try:
            doc = parse_line(n, line, loader=True)  # lm-eval reads this file
        except BadLine as exc:
            problems.append(exc.at(data_path))
            continue
        if not isinstance(doc, dict):
            problems.append(
                f'{data_path}:{n}: a line must be a JSON object (one document: {{"field": value, ...}}), '
                f"got {type(doc).__name__}"
            )
            continue
        docs.append((n, doc))
    return problems, docs, lines


Row = tuple[int, dict, dict]  # (line, the document as written, the document as the datasets loader returns it)


def check_data(
    config: dict,
    data_path: Path,
    rows: list[Row],
    where: Callable[..., str],
    render: bool = True,
    scored: int | None = None,
    refused: bool = False,
) -> tuple[list[str], list[tuple[dict | None, dict | None]]]:
    """(problems, rendered) of the documents of one JSONL data file, checked on what lm-eval will see.

    `rendered` holds, per row, what the task's templates give for it (templates.lm_eval_value by key) as a
    scored document and as a few-shot example (fewshot_config's templates over the task's), None where a
    template failed or was not rendered.

    `rows` pair each line's document as written with the document the datasets loader returns for it
    (quantgate/loader.py): templates are rendered on the loaded one (a float where the file has an integer,
    None for a field the line lacks), the line's text says whether a field is missing or null. Checks the
    fields the templates reference that a document lacks, a document given twice, and, with `render`, what
    every document's templates give in the sandbox (quantgate/templates.py check_document: rendering errors,
    a multiple_choice target that is not an index into the choices or is the answer text, empty or duplicate
    choices, unsafe templates). `where(key)` names the task file's line of a key. Pass render=False when
    check_templates refused a template: it is then not rendered at all. `scored`: how many of the first rows
    lm-eval scores (team.yaml `limit`; None: all, 0: a file of few-shot examples only); a repeat among them counts
    twice in the paired test and is refused, one elsewhere is never scored and is not.

    One float in an integer column makes the loader read every value of it as a float: a line whose problems
    come only from that is not reported when the line with the float is, or when `refused` (quantgate's own
    line rules refused lines of the file, e.g. a NaN, which the loader reads as a float).
    """
    problems: list[str] = []
    try:
        fields = template_fields(config)
    except ValueError:  # check_templates reports it, with the task file's line
        fields, render = {}, False
    features = {f for _, _, doc in rows for f in doc}
    fewshot = config.get("fewshot_config") if isinstance(config.get("fewshot_config"), dict) else {}
    # few-shot examples are documents of these files too, rendered with fewshot_config's templates
    shots = {
        k: fewshot[k] for k in ("doc_to_text", "doc_to_target", "doc_to_choice") if isinstance(fewshot.get(k), str)
    }
    skip: set[str] = set()
    shot_skip: set[str] = set(RENDERED) - set(shots)
    seen: dict[str, int] = {}
    seen_rendered: dict[str, int] = {}
    rendered: list[tuple[dict | None, dict | None]] = []
    flagged: set[int] = set()  # lines with a problem
    widened: list[tuple[int, set[str], list[str]]] = []  # (place in problems, fields, problems held back)
    for n, written, doc in rows:
        main, shot = {}, {}
        before, floated = len(problems), _floated(written, doc)
        plain = {**doc, **{f: written[f] for f in floated}} if floated else None
        # a repeated document counts twice in the paired test, as if it were two pieces of evidence
        paired = scored is None or len(rendered) < scored  # this row is one of the scored documents
        if paired and (first := seen.setdefault(_key(doc), n)) != n:
            problems.append(f"{data_path}:{n}: repeats the document of line {first}; remove the repeat")
            first = None  # reported
        missing = sorted({(f, key) for key, fs in fields.items() for f in fs if doc.get(f) is None})
        for f, key in missing:
            state = "null; give it a value" if f in written else "missing; add it"
            problems.append(f"{data_path}:{n}: field {f!r} used by {key} is {state} or fix the template")
        held: list[str] = []
        if render and not missing:
            found, held = _check_widened(config, doc, plain, features, f"{data_path}:{n}", where, skip, main)
            problems += found
        if render and shots:
            found, more = _check_widened(
                {**config, **shots},
                doc,
                plain,
                features,
                f"{data_path}:{n} (as a few-shot example)",
                lambda *at: where("fewshot_config", *at),
                shot_skip,
                shot,
            )
            problems += found
            held += more
        if held:
            widened.append((len(problems), floated, held))
        # ... and so does one that differs only in fields no template reads (an id): lm-eval scores what renders
        if paired and first == n and main and (same := seen_rendered.setdefault(_key(main), n)) != n:
            problems.append(
                f"{data_path}:{n}: renders the same prompt and answer as line {same} (they differ only in "
                "fields no template reads), so lm-eval would score one document twice; remove the repeat"
            )
        rendered.append((main or None, {**main, **shot} if main and (shot or not shots) else None))
        if len(problems) > before:
            flagged.add(n)
    if not refused:  # a float among integers changes every line's rendering ("12" becomes "12.0"): name it
        for n, written, column in _widening(rows):
            if n not in flagged:
                among = any(type(w.get(column)) is int and not _widens(w.get(column)) for m, w, _ in rows if m != n)
                problems.append(_widening_problem(data_path, n, column, written[column], among))
                flagged.add(n)
    fields = set().union(*(f for _, f, _ in widened))
    causes = {n for n, written, _ in rows if any(_widens(written.get(f)) for f in fields)}
    if widened and not refused and not causes & flagged:  # no line here says why: keep what lm-eval would hit
        for place, _, held in reversed(widened):
            problems[place:place] = held
    return problems, rendered


def _widens(value) -> bool:
    """True for a value that makes the loader read its whole column as floats: a float, or an integer beyond the
    64-bit ones it keeps as integers (pyarrow reads 2**63 as a float, and then every integer of the column too)."""
    return type(value) is float or (type(value) is int and not -(2**63) <= value < 2**63)


def _widening(rows) -> list[tuple[int, dict, str]]:
    """(line, written, field) of each line that gives a float (or an integer outside the signed 64-bit range) in a
    field other lines give as integers, which the loader then read as floats everywhere: lm-eval renders and
    compares 12 as "12.0" (a generate_until target then never matches the model's "12", and both builds score 0: a
    gate that measures nothing)."""
    columns = set().union(*(_floated(written, doc) for _, written, doc in rows))
    return [(n, written, f) for n, written, _ in rows for f in sorted(columns) if _widens(written.get(f))]


def _widening_problem(data_path, n: int, field: str, value: float | int, among: bool = True) -> str:
    """The line's problem: what its float (or its integer outside the signed 64-bit range) does to the other lines
    (`among`: some give integers the loader would keep) or, for an integer no other line gives one beside, to
    itself, and what to write instead."""
    if isinstance(value, int):
        what, fix = "an integer outside the signed 64-bit range", f'give it as text ("{value}") or a smaller number'
        if not among:  # "where the other lines give integers" was said of a column no other line gives
            return (
                f"{data_path}:{n}: {field}={value!r} is {what} (the loader keeps integers from -2**63 to 2**63-1): "
                f"it reads it as the float {float(value)!r}, and lm-eval renders and compares that; {fix}"
            )
    else:
        what = "a float"
        fix = f"write {int(value)}" if value.is_integer() else "give every line the same kind of number (or text)"
    return (
        f"{data_path}:{n}: {field}={value!r} is {what} where the other lines give integers: the loader then reads "
        f"every line's {field!r} as a float, and lm-eval renders and compares 12 as '12.0'; {fix}"
    )


def _floated(written: dict, doc: dict) -> set[str]:
    """Fields a line gives as integers that the datasets loader read as floats: it reads a whole column as
    floats when one line of the file (or of another split of the task) gives a float there."""
    return {f for f, value in written.items() if type(value) is int and isinstance(doc.get(f), float)}


def _check_widened(
    config: dict,
    doc: dict,
    plain: dict | None,
    features: set[str],
    at: str,
    where: Callable[..., str],
    skip: set[str],
    rendered: dict,
) -> tuple[list[str], list[str]]:
    """(problems, held back) of one document: check_document on `doc` as the loader reads it; when that fails
    only because the loader read the line's integers as floats (`plain`: the document with them back, or
    None), the problems are held back, not reported: the line that gives the float is, at its line, and one
    float would otherwise put every line of the file in the report. `rendered` then holds `plain`'s values.
    When `plain` fails too, its problems are reported: they name the line's values as written (`answer=7 is not
    an index`, not the loader's `answer=7.0 is a float`)."""
    kept = set(skip)
    found = check_document(config, doc, features, at, where, skip, rendered)
    if not found or plain is None or skip != kept:  # a refused or timed-out template is reported once: keep it
        return found, []
    again: dict = {}
    if own := check_document(config, plain, features, at, where, set(skip), again):
        return own, []
    rendered.clear()
    rendered.update(again)
    return [], found


def _key(value: dict) -> str:
    """A document (or what its templates render) as one comparable string."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


# lm-eval filters a team task may use (lm_eval/filters): none runs code the team wrote.
SAFE_FILTERS = (
    "regex",
    "multi_choice_regex",
    "remove_whitespace",
    "lowercase",
    "uppercase",
    "map",
    "take_first",
    "take_first_k",
    "majority_vote",
)


def _filter_params(name: str) -> set[str] | None:
    """Keyword arguments lm-eval's filter `name` takes (None: any)."""
    import inspect

    import lm_eval.filters  # noqa: F401  registers the built-in filters
    from lm_eval.api.registry import get_filter

    params = inspect.signature(get_filter(name).__init__).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params} - {"self"}


def _as_list(value) -> list:
    return [] if value is None else value if isinstance(value, list) else [value]


def check_filters(where: Callable[..., str], config: dict) -> list[str]:
    """Problems in a task's `filter_list` and the regular expressions it and `metric_list` give
    lm-eval: a filter that is not one of SAFE_FILTERS, an argument the filter does not take, a
    regular expression that does not compile or backtracks without end (sandbox.slow_regex).
    `where(*key path)` names the task file's line (templates.key_locator)."""
    problems, regexes = [], []
    filters = config.get("filter_list")
    if filters is not None and not isinstance(filters, list):
        return [f"{where('filter_list')}: filter_list must be a list of {{name: ..., filter: [{{function: ...}}]}}"]
    for i, entry in enumerate(filters or []):
        steps = entry.get("filter") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not isinstance(steps, list):
            problems.append(
                f"{where('filter_list', i)}: filter_list[{i}] needs a `name:` and a `filter:` list of "
                "{function: ...} steps"
            )
            continue
        for j, step in enumerate(steps):
            loc, fn = where("filter_list", i, "filter", j), step.get("function") if isinstance(step, dict) else None
            if fn not in SAFE_FILTERS:
                problems.append(
                    f"{loc}: filter_list[{i}].filter[{j}]: function {fn!r} is not one of lm-eval's "
                    f"filters a team may use {list(SAFE_FILTERS)}; custom filters would run code"
                )
                continue
            allowed = _filter_params(fn)
            for arg in sorted(set(step) - {"function"} - (allowed if allowed is not None else set(step))):
                problems.append(
                    f"{loc}: filter_list[{i}].filter[{j}]: {fn} takes no argument {arg!r}; it takes {sorted(allowed)}"
                )
            at = ("filter_list", i, "filter", j)
            regexes += [
                (where(*at, "regex_pattern"), f"filter_list[{i}].filter[{j}].regex_pattern", step.get("regex_pattern"))
            ]
            regexes += [
                (where(*at, "regexes_to_ignore", k), f"filter_list[{i}].filter[{j}].regexes_to_ignore[{k}]", r)
                for k, r in enumerate(_as_list(step.get("regexes_to_ignore")))
            ]
    for i, m in enumerate(config.get("metric_list") or []):
        if isinstance(m, dict):
            regexes += [
                (where("metric_list", i, "regexes_to_ignore", k), f"metric_list[{i}].regexes_to_ignore[{k}]", r)
                for k, r in enumerate(_as_list(m.get("regexes_to_ignore")))
            ]
    for loc, key, pattern in regexes:
        if pattern is None:
            continue
        why = sandbox.slow_regex(pattern) if isinstance(pattern, str) else "is not a string"
        if why:
            problems.append(f"{loc}: {key}: {pattern!r} {why}")
    return problems


def min_docs_to_pass(margin: float, confidence: float) -> int:
    """Fewest paired 0/1 documents with which even two identical builds can PASS.

    With no discordant pairs the Tango score upper bound of the drop is z^2 / (n + z^2)
    (z = one-sided normal quantile at `confidence`; Tango 1998, b = c = 0), so PASS needs
    n >= z^2 (1 - margin) / margin. margin in metric units (0.05 = 5 points), 0 < margin < 1.
    """
    z = stats.norm.ppf(confidence)
    return math.ceil(z * z * (1.0 - margin) / margin - 1e-9)
