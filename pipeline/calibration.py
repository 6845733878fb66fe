"""Calibration text for GPTQ/AWQ, built from text this machine already has (no downloads).

Source: the docstrings of a fixed list of Python standard-library modules (English technical
prose), each wrapped in the model's chat template as a question and answer, so calibration
sees the chat format the model is served with. Not the team eval sets: calibrating on the
data that gates the build would leak the test into the build.
"""

from __future__ import annotations

import importlib
import inspect

MODULES = [
    "argparse",
    "asyncio",
    "collections",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "enum",
    "fractions",
    "functools",
    "gettext",
    "heapq",
    "http.client",
    "inspect",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "mailbox",
    "math",
    "pathlib",
    "pickle",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "timeit",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "zipfile",
]


def texts(tokenizer, n: int) -> list[str]:
    """`n` calibration strings (chat-formatted when the tokenizer has a chat template).

    Longer docs are split into paragraphs so there are enough samples; deterministic order.
    Raises ValueError if fewer than `n` samples can be built.
    """
    out = []
    for name in MODULES:
        doc = inspect.getdoc(importlib.import_module(name)) or ""
        for para in (p.strip() for p in doc.split("\n\n")):
            if len(para) < 200:
                continue
            messages = [
                {"role": "user", "content": f"Explain this part of Python's {name} module."},
                {"role": "assistant", "content": para},
            ]
            out.append(tokenizer.apply_chat_template(messages, tokenize=False) if tokenizer.chat_template else para)
            if len(out) == n:
                return out
    raise ValueError(f"only {len(out)} calibration samples available, {n} requested (quantize.*.calibration_samples)")
