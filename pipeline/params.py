"""Load one block of params.yaml into a frozen, strict pydantic model.

Each stage reads only its own block (`load_block("quantize", QuantizeParams)`); unknown keys
and wrong types fail with the dotted field path, so a typo never silently takes a default.
"""
from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline.errors import QuantgateError

PARAMS_FILE = Path("params.yaml")


class Frozen(BaseModel):
    """Base for every params/policy block: immutable, no unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid")


T = TypeVar("T", bound=BaseModel)


def read_yaml(path: Path) -> object:
    """Parse a YAML file; raise QuantgateError naming the file and line on any problem."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise QuantgateError(f"{path}: file not found") from None
    except UnicodeDecodeError as exc:
        raise QuantgateError(f"{path}: not UTF-8 (byte {exc.start}); save it as UTF-8") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise QuantgateError(f"{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from None


def parse(model: type[T], data: object, where: str) -> T:
    """Validate `data` into `model`; errors name `where` plus the dotted field path."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{where}.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" if e["loc"] else f"{where}: {e['msg']}"
            for e in exc.errors()
        )
        raise QuantgateError(problems) from None


def load_block(key: str, model: type[T], path: Path = PARAMS_FILE) -> T:
    """Return block `key` of params.yaml (dotted keys allowed, e.g. "quantize.int4") as `model`.

    Raises QuantgateError if the file, the block or a field is missing or wrong.
    """
    data = read_yaml(path)
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            raise QuantgateError(f"{path}: no block '{key}' (missing '{part}'); see README 'params.yaml'")
        data = data[part]
    return parse(model, data, f"{path}:{key}")
