"""Render benchmarks/results/*.json as the Markdown of the README's "Numbers" section.

    .venv/bin/python -m benchmarks.numbers [NAME ...] [--out FILE]   # default: every result there is

Renders, per result: its title, the command that produced it, the machine and date, the
table and its notes; to stdout, or to FILE (written whole or not at all). A missing result is
named on stderr and skipped. Paste the output into README.md (nothing is rewritten in place).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS
from pipeline.errors import QuantgateError, run_main

ORDER = ("pipeline_cost", "incremental", "eval_engine", "serving", "quality")


def machine_line(m: dict) -> str:
    """One line naming the machine a result was measured on."""
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ", no GPU"
    vllm = m.get("serving", {}).get("vllm")
    return f"{m.get('cpu', '?')} ({m.get('cores')} cores, {m.get('isa')}), {m.get('memory_gib')} GiB{gpu}" + \
        (f", vLLM {vllm}" if vllm else "")


def markdown(doc: dict) -> str:
    """A result document (benchmarks.common.report's JSON) as a Markdown block.

    Raises KeyError/TypeError on a document that is not such a result."""
    rows = doc["rows"]
    cols = list(rows[0]) if rows else []
    cell = lambda v: "" if v is None else str(v)  # noqa: E731
    lines = [f"**{doc['title']}**", "",
             f"`{doc['command']}` — {doc['measured_at'][:10]}, {machine_line(doc['machine'])}", ""]
    if rows:
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    else:
        lines.append("(no rows)")
    lines += [""] + [f"- {n}" for n in doc.get("notes", [])]
    return "\n".join(lines) + "\n"


def render(names: list[str]) -> str:
    """Markdown of the named results (default: every one in ORDER that exists)."""
    blocks = []
    for name in names or ORDER:
        path = RESULTS / f"{name}.json"
        if not path.is_file():
            if names:
                raise QuantgateError(f"{path}: no such result; run python -m benchmarks.{name} first")
            print(f"numbers: {path.name} missing (python -m benchmarks.{name} makes it); skipped", file=sys.stderr)
            continue
        try:
            blocks.append(markdown(json.loads(path.read_text())))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise QuantgateError(f"{path}: not a benchmark result ({type(exc).__name__}: {exc}); re-run "
                                 f"python -m benchmarks.{name}") from None
    if not blocks:
        raise QuantgateError(f"no results in {RESULTS}; run a benchmark first, e.g. python -m benchmarks.pipeline_cost")
    return "\n".join(blocks)


def main() -> None:
    ap = argparse.ArgumentParser(prog="benchmarks.numbers", description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(ORDER)} (default: all)")
    ap.add_argument("--out", type=Path, default=None, help="write the Markdown to this file instead of stdout")
    args = ap.parse_args()
    unknown = [n for n in args.names if n not in ORDER]
    if unknown:
        raise QuantgateError(f"unknown result {unknown[0]!r}; give one of {', '.join(ORDER)}")
    text = render(args.names)
    if args.out is None:
        print(text, end="")
        return
    fd, tmp = tempfile.mkstemp(dir=args.out.parent if args.out.parent.is_dir() else None, suffix=".md")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, args.out)
    print(f"numbers: wrote {args.out}")


if __name__ == "__main__":
    run_main(main)
