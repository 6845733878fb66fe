"""A team task's templates: where lm-eval renders them, whether they are safe, what they give.

- `check_templates`: every template string of a task YAML parses and reaches nothing past the
  document (quantgate/sandbox.py unsafe_parts), reported with the task file's line of the key.
- `lm_eval_value`: what lm-eval's ConfigurableTask.doc_to_text / doc_to_target / doc_to_choice
  return for one document (lm_eval/api/task.py, 0.4.13: a key naming a field gives the field;
  otherwise the template is rendered, a choice list read with ast.literal_eval, a rendered
  "3" read as the number 3 when the task has choices, a rendered "[...]" target as a list),
  rendered in the sandbox.
- `check_document`: renders one document's templates in the sandbox, under a time limit, and
  checks what they give: a prompt is text; for multiple_choice the choices are a list of 2 or
  more distinct non-empty strings (or numbers) and the target an index into them; for
  loglikelihood(_rolling) the target is text.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path

import jinja2
from jinja2.sandbox import SecurityError

from quantgate import sandbox
from quantgate.params import key_lines

# Task keys lm-eval renders per document (description and gen_prefix as plain text), and
# keys it renders only in modes quantgate does not use, which are checked but not rendered.
RENDERED = ("doc_to_text", "doc_to_choice", "doc_to_target", "description", "gen_prefix")
CHECKED = RENDERED + ("doc_to_decontamination_query",)
POLICY_HINT = "a template may use the document's fields, filters and tests only (evals/README.md)"


def template_sources(config: dict) -> list[tuple[tuple, str]]:
    """(YAML key path, template) of every template string in a task config, fewshot_config's included."""
    found = [((key,), config[key]) for key in CHECKED if isinstance(config.get(key), str)]
    fewshot = config.get("fewshot_config")
    if isinstance(fewshot, dict):
        found += [(("fewshot_config", key), fewshot[key]) for key in CHECKED if isinstance(fewshot.get(key), str)]
    return found


def key_locator(task_path: Path) -> Callable[..., str]:
    """where(*key path) -> "task.yaml:LINE" of that key (the file alone if it is not found);
    the file's lines are read once, on first use (quantgate.params.key_lines)."""
    lines: dict[tuple, int] | None = None

    def where(*at) -> str:
        nonlocal lines
        if lines is None:
            lines = key_lines(task_path)
        return f"{task_path}:{lines[at]}" if at in lines else str(task_path)

    return where


def check_templates(where: Callable[..., str], config: dict) -> list[str]:
    """Problems in a task's templates found without documents: syntax errors and what
    sandbox.unsafe_parts refuses, one line each with the task file's line (`where`, key_locator)
    and the expression."""
    problems = []
    for at, source in template_sources(config):
        key = ".".join(at)
        try:
            parts = sandbox.unsafe_parts(source)
            sandbox.compile_template(source)  # an unknown filter or test fails here, not at parse
        except jinja2.TemplateSyntaxError as exc:  # TemplateAssertionError (unknown filter) included
            problems.append(f"{where(*at)}: {key}: template syntax error: {exc.message.rstrip('.')}; fix the template")
            continue
        except RecursionError:
            problems.append(f"{where(*at)}: {key}: template nested too deeply to parse; simplify it")
            continue
        for expr, why in parts:
            problems.append(f"{where(*at)}: {key}: unsafe template `{expr}`: {why}; {POLICY_HINT}")
        for kind, name in _unknown_names(source):
            problems.append(f"{where(*at)}: {key}: template syntax error: no {kind} named {name!r}; fix the template")
    return problems


def _unknown_names(source: str) -> list[tuple[str, str]]:
    """("filter" | "test", name) of every filter or test in `source` that the sandbox lacks: Jinja checks those
    inside an `if` only when a document takes that branch, so compiling alone misses them."""
    tree = sandbox.ENV.parse(source)
    found = [("filter", n.name) for n in tree.find_all(jinja2.nodes.Filter) if n.name not in sandbox.ENV.filters]
    found += [("test", n.name) for n in tree.find_all(jinja2.nodes.Test) if n.name not in sandbox.ENV.tests]
    return list(dict.fromkeys(found))


def lm_eval_value(config: dict, key: str, doc: dict, features: set[str]):
    """What lm-eval gives for `key` (one of RENDERED) of task `config` on `doc`, rendered in the sandbox.

    `features` are the data file's fields (lm-eval's `self.features`). Raises what rendering
    raises (sandbox.render), and ValueError when a rendered doc_to_choice is not a list literal.
    """
    spec = config.get(key)
    if key == "doc_to_choice" and isinstance(spec, dict):
        return list(spec.values())
    if not isinstance(spec, str) or (key == "description" and not spec):
        return spec
    if spec in features:
        return doc.get(spec)  # a field a document lacks is None in lm-eval's dataset
    text = sandbox.render(spec, doc)
    if key == "doc_to_choice":
        try:
            return ast.literal_eval(text)
        except (SyntaxError, ValueError):
            raise ValueError(
                f"it renders {text[:60]!r}, not a list (lm-eval reads doc_to_choice with ast.literal_eval)"
            ) from None
    if key in ("doc_to_text", "doc_to_target") and text.isdigit() and config.get("doc_to_choice") is not None:
        return ast.literal_eval(text)
    if key == "doc_to_target" and len(text) >= 2 and text[0] == "[" and text[-1] == "]":
        try:
            return ast.literal_eval(text)
        except (SyntaxError, ValueError):
            return text
    return text


def _quoted(message: str) -> str | None:
    """The first 'quoted' word of a SecurityError message (the attribute it refused)."""
    m = re.search(r"'([^']+)'", message)
    return m.group(1) if m else None


def check_document(
    config: dict,
    doc: dict,
    features: set[str],
    at: str,
    where: Callable[..., str],
    skip: set[str],
    rendered: dict | None = None,
) -> list[str]:
    """Problems with what one document's templates give; `at` is "data.jsonl:LINE".

    `where(key)` is "task.yaml:LINE" of a key (key_locator). Keys in `skip` are not rendered; a key the
    sandbox refuses is reported once, at its task line, and added to `skip`; after a render
    that runs out of time every key is (the file is not rendered further). When every key renders,
    `rendered` (if given) receives {key: what lm-eval gives} (lm_eval_value).
    """
    problems, values = [], {}
    try:
        with sandbox.time_limit():
            for key in RENDERED:
                if key in skip or config.get(key) is None:
                    continue
                try:
                    values[key] = lm_eval_value(config, key, doc, features)
                except sandbox.TooLong as exc:  # this document's problem: the key is still checked on the others
                    values[key] = exc
                    problems.append(
                        f"{at}: {key}: `{sandbox.expression(config[key])}` cannot be rendered for this document: "
                        f"it {exc}; shorten the document's fields or the template"
                    )
                except SecurityError as exc:
                    skip.add(key)
                    problems.append(
                        f"{where(key)}: {key}: unsafe template "
                        f"`{sandbox.expression(config[key], _quoted(str(exc)))}`: the sandbox "
                        f"refused it rendering {at} ({exc}); {POLICY_HINT}"
                    )
                except sandbox.RenderTimeout:
                    raise
                except Exception as exc:  # the template's own error on this document
                    values[key] = exc
                    problems.append(
                        f"{at}: {key}: `{sandbox.expression(config[key])}` cannot be rendered for "
                        f"this document: {exc}; fix the document or the template"
                    )
    except sandbox.RenderTimeout as exc:
        skip.update(RENDERED)
        return problems + [
            f"{at}: rendering this document's templates took {exc}; simplify the templates "
            "(no more documents of this file were rendered)"
        ]
    if any(isinstance(v, Exception) for v in values.values()):
        return problems
    if rendered is not None:
        rendered.update(values)
    text = values.get("doc_to_text")
    if text is not None and not isinstance(text, str):
        problems.append(
            f"{at}: doc_to_text gives {type(text).__name__} {text!r}, not the prompt text"
            + (
                "; lm-eval reads a prompt of digits only as the index of a multiple-input task, which "
                "quantgate does not support: add words to the prompt"
                if isinstance(text, int)
                else ""
            )
        )
    if config.get("output_type") == "multiple_choice" and {"doc_to_choice", "doc_to_target"} <= set(values):
        problems += _choice_problems(config, values["doc_to_choice"], values["doc_to_target"], at)
    if config.get("output_type") in ("loglikelihood", "loglikelihood_rolling") and "doc_to_target" in values:
        target = values["doc_to_target"]
        if not isinstance(target, str) or not target.strip():
            problems.append(
                f"{at}: doc_to_target gives {type(target).__name__} {repr(target)[:60]}; a "
                f"{config['output_type']} task scores the likelihood of the target's text: give the answer as text"
            )
    return problems


def _choice_problems(config: dict, choices, target, at: str) -> list[str]:
    """A multiple_choice document's choices: a list of 2 or more distinct non-empty strings (or
    numbers); its target: an index into them."""
    if (
        not isinstance(choices, list)
        or not choices
        or not all(
            (isinstance(c, str) and c.strip()) or (isinstance(c, (int, float)) and not isinstance(c, bool))
            for c in choices
        )
    ):
        return [f"{at}: choices must be a non-empty list of non-empty strings, got {str(choices)[:80]}"]
    if len(choices) < 2:  # the one choice is always the most likely: every build scores 1 and PASSes
        if isinstance(config.get("doc_to_choice"), list):
            return []  # a fixed list: check_task names it once, at its line
        return [f"{at}: only one choice {str(choices)[:80]}: every build would score it right; give 2 or more"]
    problems = []
    if len(set(map(str, choices))) != len(choices):
        problems.append(f"{at}: duplicate choices {choices}; make them distinct")
    spec = config.get("doc_to_target")
    name = spec.strip("{} ") if isinstance(spec, str) and spec.strip("{} ").isidentifier() else "doc_to_target"
    if isinstance(target, str) and target in map(str, choices):
        problems.append(
            f"{at}: {name} is the answer text {target!r}; "
            f"use its index {list(map(str, choices)).index(target)} into the choices"
        )
    elif isinstance(target, float):
        problems.append(
            f"{at}: {name}={target!r} is a float where an integer index into {len(choices)} choices "
            f"(0..{len(choices) - 1}) is expected; write the index without a decimal point (one float in a "
            "column makes the datasets loader that lm-eval reads the file with read the whole column as floats)"
        )
    elif not isinstance(target, int) or isinstance(target, bool) or not 0 <= target < len(choices):
        problems.append(f"{at}: {name}={target!r} is not an index into {len(choices)} choices (0..{len(choices) - 1})")
    return problems
