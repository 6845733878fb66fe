"""Render benchmarks/results/*.json as the Markdown of the README's "Numbers" section.

    .venv/bin/python -m benchmarks.numbers [NAME ...]   # default: every result, in question order

Prints, per result: its title, the command that produced it, the machine and date, the
table and its notes. Paste the output into README.md (nothing is rewritten in place).
"""
from __future__ import annotations

import json
import sys

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
    """A result document (benchmarks.common.report's JSON) as a Markdown block."""
    rows = doc["rows"]
    cols = list(rows[0]) if rows else []
    cell = lambda v: "" if v is None else str(v)  # noqa: E731
    lines = [f"**{doc['title']}**", "",
             f"`{doc['command']}` — {doc['measured_at'][:10]}, {machine_line(doc['machine'])}", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    lines += [""] + [f"- {n}" for n in doc.get("notes", [])]
    return "\n".join(lines) + "\n"


def main() -> None:
    names = sys.argv[1:] or [n for n in ORDER if (RESULTS / f"{n}.json").is_file()]
    if not names:
        raise QuantgateError(f"no results in {RESULTS}; run a benchmark first, e.g. python -m benchmarks.pipeline_cost")
    for name in names:
        path = RESULTS / f"{name}.json"
        if not path.is_file():
            raise QuantgateError(f"{path}: no such result; run python -m benchmarks.{name} first")
        print(markdown(json.loads(path.read_text())))


if __name__ == "__main__":
    run_main(main)
