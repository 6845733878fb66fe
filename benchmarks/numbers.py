"""Render benchmarks/results/*.json as Markdown: every table whole, and the README's "Numbers" section.

    .venv/bin/python -m benchmarks.numbers [NAME ...] [--out FILE] [--readme README.md]

Renders, per result: its title, the command that produced it, the machine and date, the
table and its notes; to stdout, or to FILE (written whole or not at all). NAME is a result's file name without
.json; by default every result, ORDER's first (a missing one named on stderr and skipped), then the others
(gateway, search_estimate, ray_evaluate, the quality_* sweeps). --readme FILE replaces the text between
`<!-- numbers:start -->` and `<!-- numbers:end -->` in FILE with a shorter view of ORDER's results (README_VIEW:
the columns and notes a reader needs), written whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common import RESULTS
from quantgate.errors import QuantgateError, run_main
from quantgate.files import write_whole

ORDER = ("pipeline_cost", "incremental", "eval_engine", "serving", "quality", "canary_sim")
START, END = "<!-- numbers:start -->", "<!-- numbers:end -->"
# README view per result: (columns kept, indices of the notes kept); the full tables are in --out
README_VIEW = {
    "pipeline_cost": (["stage", "cold s", "cold GiB", "cold server start s", "cold scoring s", "warm s"], [0, 1]),
    "incremental": (["teams", "scenario", "wall s", "stages run", "one team's eval s", "ratio"], [1, 2]),
    "eval_engine": (
        ["team", "docs", "requests", "vllm_score", "hf_score", "agree_pct", "vllm_s", "hf_s", "vllm_rps", "hf_rps"],
        [0, 1],
    ),
    "serving": (
        [
            "build",
            "C",
            "disk MiB",
            "mem GiB",
            "KV tokens",
            "tok/s",
            "TTFT ms p50/90/99",
            "TPOT ms p50/90/99",
            "size×",
            "tok/s×",
            "TPOT×",
            "note",
        ],
        [0],
    ),
    "quality": (["team", "build", "n", "fp16", "candidate", "recovery_pct", "ci_low", "ci_high", "verdict"], [0, 1]),
    "canary_sim": (
        [
            "scenario",
            "canaries",
            "aborted %",
            "95% CI",
            "on a FAIL %",
            "candidate requests to abort (median / p90)",
            "minutes (median / p90)",
        ],
        [0, 1],
    ),
}


def machine_line(m: dict) -> str:
    """One line naming the machine a result was measured on."""
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ", no GPU"
    vllm = m.get("serving", {}).get("vllm")
    return f"{m.get('cpu', '?')} ({m.get('cores')} cores, {m.get('isa')}), {m.get('memory_gib')} GiB{gpu}" + (
        f", vLLM {vllm}" if vllm else ""
    )


def markdown(
    doc: dict, columns: list[str] | None = None, notes: list[int] | None = None, heading: str | None = None
) -> str:
    """A result document (benchmarks.common.report's JSON) as a Markdown block: `columns` of
    its rows (default all), the notes at indices `notes` (default all), under `heading`
    (default its title).

    Raises KeyError/TypeError on a document that is not such a result."""
    rows = doc["rows"]
    cols = columns or (list(rows[0]) if rows else [])
    cell = lambda v: "" if v is None else str(v)  # noqa: E731
    lines = [
        f"**{heading or doc['title']}**",
        "",
        f"`{doc['command']}` — {doc['measured_at'][:10]}, {machine_line(doc['machine'])}",
        "",
    ]
    if rows:
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    else:
        lines.append("(no rows)")
    kept = (
        doc.get("notes", [])
        if notes is None
        else [doc.get("notes", [])[i] for i in notes if i < len(doc.get("notes", []))]
    )
    lines += [""] + [f"- {n}" for n in kept]
    return "\n".join(lines) + "\n"


def load(name: str, required: bool) -> dict | None:
    """The result document `name` from RESULTS; None (named on stderr) if missing and not `required`.

    Raises QuantgateError when required and missing, or when the file is not a result."""
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        if required:
            raise QuantgateError(f"{path}: no such result; run python -m benchmarks.{name} first")
        print(f"numbers: {path.name} missing (python -m benchmarks.{name} makes it); skipped", file=sys.stderr)
        return None
    try:
        doc = json.loads(path.read_text())
        markdown(doc)  # a document that cannot be rendered is not a result
        return doc
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise QuantgateError(
            f"{path}: not a benchmark result ({type(exc).__name__}: {exc}); re-run python -m benchmarks.{name}"
        ) from None


def available() -> list[str]:
    """Every result's name: ORDER's, then those of the other results in RESULTS (their file names without .json),
    sorted."""
    return [*ORDER, *sorted(p.stem for p in RESULTS.glob("*.json") if p.stem not in ORDER)]


def render(names: list[str], readme: bool = False) -> str:
    """Markdown of the named results (default: every result, `available()`); the README view (README_VIEW, numbered
    headings: ORDER's results only) if `readme`."""
    blocks = []
    for name in names or (ORDER if readme else available()):
        doc = load(name, required=bool(names))
        if doc is None:
            continue
        if readme:
            columns, notes = README_VIEW[name]
            blocks.append(markdown(doc, columns, notes, f"{ORDER.index(name) + 1}. {doc['title']}"))
        else:
            blocks.append(markdown(doc))
    if not blocks:
        raise QuantgateError(f"no results in {RESULTS}; run a benchmark first, e.g. python -m benchmarks.pipeline_cost")
    return "\n".join(blocks)


def replace_section(readme: Path, text: str) -> str:
    """`readme`'s content with the text between START and END replaced by `text`.

    Raises QuantgateError naming the file when it or either marker is missing, or they are out of order."""
    try:
        content = readme.read_text()
    except OSError as exc:
        raise QuantgateError(f"{readme}: cannot read ({exc.strerror})") from None
    a, b = content.find(START), content.find(END)
    if a < 0 or b < 0 or b < a or content.count(START) > 1 or content.count(END) > 1:
        raise QuantgateError(
            f"{readme}: needs the lines {START} and {END} once each (in that order) around the Numbers tables"
        )
    return content[: a + len(START)] + "\n" + text + "\n" + content[b:]


def file_args(args: argparse.Namespace) -> None:
    """--out and --readme as Paths (None when not given). Raises QuantgateError naming the option when one is
    empty ('', e.g. an unset shell variable): Path("") is ".", the working directory, read or written as a file."""
    for flag, example in (("out", "benchmarks/results/numbers.md"), ("readme", "README.md")):
        given = getattr(args, flag)
        if given == "":
            raise QuantgateError(f"--{flag} is empty; give a file, e.g. --{flag} {example}, or drop --{flag}")
        setattr(args, flag, None if given is None else Path(given))


def main() -> None:
    ap = argparse.ArgumentParser(prog="benchmarks.numbers", description=__doc__.split("\n\n")[0])
    known = available()  # one listing of RESULTS for the help, the check and its message
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(known)} (default: all)")
    ap.add_argument("--out", default=None, help="write the Markdown to this file instead of stdout")
    ap.add_argument("--readme", default=None, help="replace the Numbers section of this README")
    args = ap.parse_args()
    file_args(args)
    unknown = [n for n in args.names if n not in known]
    if unknown:
        raise QuantgateError(f"unknown result {unknown[0]!r}; give one of {', '.join(known)}")
    if args.readme is not None and args.names:
        raise QuantgateError("--readme renders every result (the README section is replaced whole); name no results")
    text = render(args.names)
    section = replace_section(args.readme, render([], readme=True)) if args.readme is not None else None
    if args.out is not None:
        write_whole(args.out, text)
        print(f"numbers: wrote {args.out}")
    if section is not None:
        write_whole(args.readme, section)
        print(f"numbers: updated the Numbers section of {args.readme}")
    if args.out is None and args.readme is None:
        print(text, end="")


if __name__ == "__main__":
    run_main(main)
