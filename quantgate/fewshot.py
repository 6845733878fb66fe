"""Few-shot examples never come from the scored documents.

lm-eval 0.4.13 takes a task's few-shot examples (ConfigurableTask.fewshot_docs) from `fewshot_config.split`,
else `fewshot_split`, else inline `fewshot_config.samples` (which quantgate refuses, quantgate/checks.py), else
the first of training_split, validation_split and test_split that is set: a task with `num_fewshot: 3` and no
few-shot split takes its examples from the documents it scores, and with the `first_n` sampler the first
documents are shown with their own answers. So `num_fewshot > 0` needs a few-shot split other than the scored
one, read from another file, and no example whose rendered prompt is the prompt of a scored document.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from quantgate.taskdata import capped


def scored_split(config: dict) -> str | None:
    """The split lm-eval scores (Task.eval_docs): test_split, else validation_split."""
    return config.get("test_split") or config.get("validation_split")


def fewshot_source(config: dict) -> tuple[str | None, str]:
    """(split lm-eval draws few-shot examples from, the setting that chose it), as ConfigurableTask.fewshot_docs
    resolves it; (None, "") when there is none."""
    fewshot = config.get("fewshot_config") if isinstance(config.get("fewshot_config"), dict) else {}
    for split, setting in (
        (fewshot.get("split"), "fewshot_config.split"),
        (config.get("fewshot_split"), "fewshot_split"),
        (config.get("training_split"), "training_split (no fewshot_split)"),
        (config.get("validation_split"), "validation_split (no fewshot_split)"),
        (config.get("test_split"), "test_split (no fewshot_split)"),
    ):
        if split is not None:
            return split, setting
    return None, ""


def check_source(where: Callable[..., str], config: dict, files: dict[str, Path]) -> list[str]:
    """Problems with where a task's few-shot examples come from, when num_fewshot > 0: none at all, the scored
    split, or the scored split's file under another split name. `files` are the task's data files by split
    (resolved paths); `where(*key path)` names the task file's line (templates.key_locator)."""
    shots = config.get("num_fewshot")
    if not isinstance(shots, int) or isinstance(shots, bool) or shots <= 0:
        return []
    scored = scored_split(config)
    split, setting = fewshot_source(config)
    fix = (
        "put the examples in a file of their own and name its split, e.g. data_files: {test: data.jsonl, "
        "train: fewshot.jsonl} and fewshot_split: train"
    )
    if split is None or split == scored:
        scored_file = files.get(scored, Path(str(scored)))
        return [
            f"{where('num_fewshot')}: num_fewshot: {shots} takes its examples from the scored documents "
            f"({scored_file.name}, split {scored!r}, by {setting or 'no fewshot_split'}): they would be shown "
            f"with their answers; {fix}"
        ]
    if split in files and scored in files and files[split] == files[scored]:
        key = ("fewshot_config", "split") if setting == "fewshot_config.split" else ("fewshot_split",)
        return [
            f"{where(*key)}: {setting} {split!r} reads {files[split].name}, the scored file (split {scored!r}): "
            f"every example is a scored document; {fix}"
        ]
    return []


def _prompt(values: dict | None) -> str | None:
    """A rendered doc_to_text, whitespace runs as one space (None if it did not render to text)."""
    text = (values or {}).get("doc_to_text")
    return " ".join(text.split()) if isinstance(text, str) and text.strip() else None


def leaks(
    scored: list[tuple[int, dict | None]],
    examples: list[tuple[int, dict | None]],
    scored_path: Path,
    example_path: Path,
    setting: str,
) -> list[str]:
    """One problem per few-shot example whose rendered prompt (doc_to_text, fewshot_config's if it has one) is
    the rendered prompt of a scored document. `scored` and `examples` are (line, rendered values) as
    checks.check_data gives them (a scored document's main values, an example's few-shot values)."""
    lines: dict[str, int] = {}
    for n, values in scored:
        if (text := _prompt(values)) is not None:
            lines.setdefault(text, n)
    fix = (
        f"remove it from {example_path.name} or from {scored_path.name}"
        if example_path != scored_path
        else "put the few-shot examples in a file of their own"  # one file: removing the line removes both
    )
    return [
        f"{example_path}:{n}: this few-shot example ({setting}) renders the prompt of the scored document "
        f"{scored_path}:{lines[text]} ({text[:60]!r}): that document would be shown with its answer; {fix}"
        for n, values in examples
        if (text := _prompt(values)) is not None and text in lines
    ]


def check_examples(
    where: Callable[..., str],
    config: dict,
    files: dict[str, Path],
    rows: dict[str, list],
    rendered: dict[str, list[tuple[dict | None, dict | None]]],
    compare: bool,
) -> tuple[list[str], list[dict | None]]:
    """(problems, the few-shot examples as rendered) of a task with `num_fewshot` (none: ([], [])).

    Problems: where the examples come from (check_source), fewer examples than num_fewshot, and, with `compare`
    (every document rendered without a problem), examples whose rendered prompt is a scored document's (leaks,
    at most 20 listed: taskdata.capped), unless the examples are the scored file's (check_source says it once).
    `files`, `rows` and `rendered` are by split: the resolved data files, their (line, as written, as loaded)
    rows and what checks.check_data rendered for each row (scored, few-shot).
    """
    shots, (split, setting), scored = config.get("num_fewshot"), fewshot_source(config), scored_split(config)
    if not isinstance(shots, int) or isinstance(shots, bool) or shots <= 0:
        return [], []
    problems = check_source(where, config, files)
    if split in rows and shots > len(rows[split]):
        problems.append(
            f"{where('num_fewshot')}: num_fewshot {shots} but the {split!r} split has {len(rows[split])} "
            "documents; add examples or lower num_fewshot"
        )
    if split == scored or split not in rendered or scored not in rendered:
        return problems, []
    examples = [shot for _, shot in rendered[split]]
    if compare and files[split] != files[scored]:  # the scored file itself: check_source's one line says so
        found = leaks(
            [(n, main) for (n, _, _), (main, _) in zip(rows[scored], rendered[scored], strict=True)],
            [(n, shot) for (n, _, _), shot in zip(rows[split], examples, strict=True)],
            files[scored],
            files[split],
            setting,
        )
        problems += capped(files[split], found)
    return problems, examples
