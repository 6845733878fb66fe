"""Load one block of params.yaml into a frozen, strict pydantic model.

Each stage reads only its own block (`load_block("quantize", QuantizeParams)`); unknown keys,
wrong types and duplicate keys fail with the file, line and dotted field path
("params.yaml:57: canary.alpha: ..."), so a typo never silently takes a default; a top-level key that
no block is (`check_blocks`, BLOCKS) fails the same way.
"""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path
from types import UnionType
from typing import Annotated, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from quantgate.errors import QuantgateError
from quantgate.files import not_to_open

PARAMS_FILE = Path("params.yaml")


class Frozen(BaseModel):
    """Base for every params/policy block: immutable, no unknown keys, strict types (YAML
    `true` or `"64"` for an int field is refused, not read as 1 or 64), finite numbers (YAML's `.inf`
    and `.nan` are refused: an infinite timeout or rate would disable the bound it sets)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)


T = TypeVar("T", bound=BaseModel)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently).

    Only the mapping's own scalar keys are compared: merge keys (`<<: *base`) and the keys
    they bring in are PyYAML's to resolve (an explicit key overrides a merged one), and a
    non-scalar key is left to PyYAML, which refuses it as unhashable."""

    def construct_mapping(self, node, deep=False):
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {seen[key]}); keep one", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def _read_text(path: Path) -> str:
    if (bad := not_to_open(path)) is not None:  # never opened: a FIFO would wait forever
        raise QuantgateError(f"{path} is {bad[0]}; {bad[1]}give the YAML file")
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        where = f" in {Path.cwd()}; run from the project folder" if not path.is_absolute() else ""
        raise QuantgateError(f"{path}: file not found{where}") from None
    except IsADirectoryError:
        raise QuantgateError(f"{path}: is a folder, not a file; give the YAML file (move the folder away)") from None
    except PermissionError:
        raise QuantgateError(f"{path}: not readable by this user; fix its permissions") from None
    except UnicodeDecodeError as exc:  # named as the JSONL reader names one: its line and the byte's value
        line = exc.object[: exc.start].count(b"\n") + 1
        raise QuantgateError(
            f"{path}:{line}: not UTF-8 (byte 0x{exc.object[exc.start]:02x}); save the file as UTF-8"
        ) from None


def read_yaml(path: Path) -> object:
    """Parse a YAML file; raise QuantgateError naming the file and line on any problem,
    a key given twice in one mapping included."""
    text = _read_text(path)
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: safe
    except RecursionError:
        raise QuantgateError(f"{path}: invalid YAML: nested too deeply; flatten it") from None
    except yaml.constructor.ConstructorError as exc:
        mark = exc.problem_mark
        tagged = "tag" in (exc.problem or "")  # not for "found unhashable key", which has no tag
        tail = "; custom tags (like !function) are not allowed: write plain YAML" if tagged else ""
        raise QuantgateError(f"{path}:{mark.line + 1}: invalid YAML: {exc.problem}{tail}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise QuantgateError(f"{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from None


def where(path: Path, dotted: str) -> str:
    """ "path:line" of the key `dotted` ("search.looks.0": list items by index) in a YAML file, or of the
    nearest key above it that is written there (a missing key: the block it belongs in); "path" alone when
    none is, or the file cannot be read."""
    keys = tuple(int(k) if k.isdigit() else k for k in dotted.split("."))
    line = line_of(key_lines(path) if Path(path).is_file() else {}, keys)
    return f"{path}:{line}" if line else str(path)


def line_of(lines: dict[tuple, int], keys: tuple) -> int | None:
    """The line of key path `keys` in `lines` (key_lines), or of its nearest enclosing key there; None if none is."""
    return next((lines[keys[:i]] for i in range(len(keys), 0, -1) if keys[:i] in lines), None)


def key_lines(path: Path) -> dict[tuple, int]:
    """{key path: 1-based line} of every mapping key and sequence item in a YAML file,
    e.g. {("canary", "alpha"): 57}; empty if the file cannot be read or parsed (read_yaml says why)."""
    try:
        root = yaml.compose(_read_text(path), Loader=yaml.SafeLoader)
    except (QuantgateError, yaml.YAMLError, RecursionError):
        return {}
    lines: dict[tuple, int] = {}
    seen: set[int] = set()

    def walk(node, at: tuple) -> None:
        if id(node) in seen:  # an alias: its lines are those of the anchor (and a billion laughs stays small)
            return
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                lines[at + (k.value,)] = k.start_mark.line + 1
                walk(v, at + (k.value,))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                lines[at + (i,)] = v.start_mark.line + 1
                walk(v, at + (i,))

    walk(root, ())
    return lines


def parse(model: type[T], data: object, where: str, source: Path | None = None, at: tuple = ()) -> T:
    """Validate `data` (found at key path `at` of file `where`) into `model`.

    Raises QuantgateError with one "where:line: dotted.field: message" per problem; the line
    is that of the field, or of its nearest enclosing key when the field is missing, read
    from the YAML file `source` (key_lines) only when there is a problem to report.
    """
    if not isinstance(data, dict):  # pydantic would say "valid dictionary or instance of <Model>"
        line = key_lines(source).get(at) if source is not None and at else None
        what = ".".join(map(str, at)) or "the file"
        raise QuantgateError(f"{where}{f':{line}' if line else ''}: {what} {_not_a_mapping(model, data)}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = key_lines(source) if source is not None else {}
        problems: dict[tuple, list[str]] = {}  # one entry per field: a union's members' messages merged
        given: dict[tuple, object] = {}
        hints: dict[tuple, str] = {}
        for e in exc.errors():
            loc = at + tuple(str(p) if not isinstance(p, int) else p for p in _without_union_tags(model, e["loc"]))
            nested = _model_at(model, e["loc"]) if e["type"] in ("model_type", "dict_type") else None
            parent = _model_at(model, e["loc"][:-1]) if e["type"] == "extra_forbidden" else None
            if nested:
                msg = _not_a_mapping(nested, e.get("input"))
            elif parent:
                msg = f"unknown key (the keys here: {_fields(parent)})"
            else:  # a validator's own ValueError is the message; pydantic's "Value error, " prefix is noise to a user
                msg = e["msg"].removeprefix("Value error, ")
                if e["type"] != "value_error" and "input" in e and not isinstance(e["input"], dict):
                    given[loc] = e["input"]  # pydantic's own messages do not say what they were given
                    if e["type"] in NUMBER_ERRORS:  # a union's other member (Literal["auto"]) must not erase it
                        hints[loc] = _as_text(e["input"], integer=e["type"] == "int_type")
                    if e["type"] == "string_type" and type(e["input"]) in (int, float):  # cpu_cores: 1
                        hints[loc] = " (YAML reads it as a number: put it in quotes as you wrote it)"
                    hints.setdefault(loc, "")
            if msg not in problems.setdefault(loc, []):
                problems[loc].append(msg)
        out = []
        for loc, msgs in problems.items():
            line = line_of(lines, loc)
            place = f"{where}:{line}" if line else where
            field = ".".join(str(p) for p in loc)
            msg = " or ".join([msgs[0], *(m.removeprefix("Input should be ") for m in msgs[1:])])
            msg += f"; got {_got(given[loc])}{hints[loc]}" if loc in given else ""
            out.append(f"{place}: {field}: {msg}" if field else f"{place}: {msg}")
        raise QuantgateError("; ".join(out)) from None


NUMBER_ERRORS = ("int_type", "float_type")  # a number field given text (the models are strict: no coercion)


def _as_text(value: object, integer: bool = False) -> str:
    """A hint for a number that YAML read as text, given to a number field: quoted, or a float PyYAML does not
    read as one (it follows YAML 1.1, whose floats need a dot and a signed exponent: 1e3 and 1.0e3 are text,
    1.0e+3 is 1000.0)."""
    if not isinstance(value, str) or not re.search(r"\d", value):  # nan, inf: words, not quoted numbers
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not math.isfinite(number):  # 1e400: no rewriting makes it a number a block takes
        return f" ({value} is beyond any float: write a finite number)"
    mantissa, e, exponent = value.lower().partition("e")
    if e and integer:  # YAML's 2.0e+3 is a float, which an integer field refuses too
        return f" (YAML 1.1 reads {value} as text: write {int(number)})" if number.is_integer() else ""
    if e:
        fixed = (
            (mantissa if "." in mantissa else mantissa + ".0")
            + "e"
            + (exponent if exponent[:1] in "+-" else "+" + exponent)
        )
        return f" (YAML 1.1 reads {value} as text: write {fixed})"
    return " (a number in quotes is text: write it unquoted)"


def _without_union_tags(model: type[BaseModel], loc: tuple) -> tuple:
    """`loc` of a pydantic error without the parts pydantic adds for a union's member (`int | Literal["auto"]`:
    "constrained-int", "literal['auto']"), found by walking `model`'s annotations along `loc`, not by name (a
    build or team may be called "int")."""
    out, current = [], model
    for part in loc:
        while get_origin(current) is Annotated:
            current = get_args(current)[0]
        if get_origin(current) in (Union, UnionType):
            members = [a for a in get_args(current) if a is not type(None)]
            if len(members) > 1:  # pydantic tags the member: drop the tag, stop walking (which member is unknown)
                current = None
                continue
            current = members[0]
            while get_origin(current) is Annotated:
                current = get_args(current)[0]
        out.append(part)
        if isinstance(current, type) and issubclass(current, BaseModel) and isinstance(part, str):
            field = current.model_fields.get(part)
            current = field.annotation if field is not None else None
        elif get_origin(current) is dict:
            current = get_args(current)[1]
        elif get_origin(current) in (list, tuple, set):
            current = get_args(current)[0] if get_args(current) else None
        else:
            current = None
    return tuple(out)


def _got(data: object) -> str:
    """What a YAML value is, for an error: "nothing (empty)", "float 0.05", "list ['a']" (60 chars)."""
    return "nothing (empty)" if data is None else f"{type(data).__name__} {data!r}"[:60]


def _not_a_mapping(model: type[BaseModel], data: object) -> str:
    """'must be a mapping of fields (a, b); got float 0.05' for a block that is not a mapping."""
    return f"must be a mapping of fields ({', '.join(model.model_fields)}); got {_got(data)}"


def _fields(model: type[BaseModel]) -> str:
    """'a, b, c': the keys a block of `model` takes."""
    return ", ".join(model.model_fields)


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model of the field at `loc` inside `model` (None when it is not a model). A field may
    hold a Model, `Model | None`, or `dict[str, Model]` (whose key is the next part of `loc`)."""
    current: object = model
    for part in loc:
        if isinstance(current, type) and issubclass(current, BaseModel) and isinstance(part, str):
            field = current.model_fields.get(part)
            if field is None:
                return None
            current = field.annotation
        elif get_origin(current) is dict:
            current = get_args(current)[1]
        else:
            return None
        if get_origin(current) in (Union, UnionType):  # Model | None
            models = [a for a in get_args(current) if a is not type(None)]
            current = models[0] if len(models) == 1 else None
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


BASELINE_BUILD = "fp16"  # prepare's 16-bit build (models/fp16 in dvc.yaml)
BUILD_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")  # a build's name: it names folders and stages
# the top-level keys of params.yaml some module reads (tests/test_layout.py keeps this equal to the blocks read
# with load_block, `builds` and the shipped params.yaml); a key starting with _ is free (YAML anchors to share)
BLOCKS = (
    "builds", "validate", "prepare", "calibrate", "quantize", "search", "evaluate", "executor", "profile", "cost",
    "gate", "register", "canary", "canary_topology", "fleet", "limits",
)  # fmt: skip


def check_blocks(path: Path = PARAMS_FILE) -> dict:
    """The parsed params.yaml, once it is a mapping of known blocks (BLOCKS). Raises QuantgateError for a file
    that is not a mapping, and for a top-level key no stage or command reads (a typo would pass silently: its
    block's defaults would run), naming the line and the closest block name."""
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise QuantgateError(
            f"{path}: must be a mapping of blocks (builds:, evaluate:, gate:, ...), got "
            f"{'an empty file' if data is None else type(data).__name__}"
        )
    for key in data:
        if not (isinstance(key, str) and key.startswith("_")) and key not in BLOCKS:
            close = difflib.get_close_matches(str(key), BLOCKS, n=1)
            hint = f"did you mean {close[0]}?" if close else f"the blocks are {', '.join(BLOCKS)}"
            raise QuantgateError(
                f"{where(path, str(key))}: {key}: no stage or command reads this block; {hint} (a key starting "
                "with _ is free for YAML anchors)"
            )
    return data


def load_builds(path: Path = PARAMS_FILE) -> list[str]:
    """params.yaml `builds`: every build of a run, listed once (dvc.yaml's evaluate `foreach` reads it too).

    Raises QuantgateError unless it is a non-empty list of distinct names with the 16-bit build among them,
    each quantized build with a quantize block and each quantize block a build.
    """
    data = check_blocks(path)
    builds = data.get("builds")
    if not (isinstance(builds, list) and builds and all(isinstance(b, str) and b for b in builds)):
        raise QuantgateError(f"{path}: `builds` must be a list of build names, e.g. [fp16, fp8, int4]; got {builds!r}")
    if len(set(builds)) != len(builds):
        raise QuantgateError(f"{path}: `builds` {builds} names a build twice; list each once")
    if bad := [b for b in builds if not BUILD_NAME.fullmatch(b)]:
        raise QuantgateError(
            f"{path}: `builds` {bad}: a build name is lowercase letters, digits, _ and - (it names folders and stages)"
        )
    if BASELINE_BUILD not in builds:
        raise QuantgateError(
            f"{path}: `builds` {builds} has no {BASELINE_BUILD}: every build is gated against the 16-bit build "
            f"prepare makes; add {BASELINE_BUILD} to builds"
        )
    quantize = data.get("quantize") if isinstance(data.get("quantize"), dict) else {}
    quantized = [b for b in builds if b != BASELINE_BUILD]
    if unbuilt := [b for b in quantized if b not in quantize]:
        raise QuantgateError(f"{path}: builds {unbuilt} have no quantize.<build> block; add one or drop the build")
    if stray := [q for q in quantize if q not in quantized]:
        raise QuantgateError(
            f"{path}: quantize.{stray[0]} is not a quantized build in `builds` {builds} "
            f"({BASELINE_BUILD} is prepare's 16-bit build); add it to builds or remove the block"
        )
    return builds


def load_block(key: str, model: type[T], path: Path = PARAMS_FILE) -> T:
    """Return block `key` of params.yaml (dotted keys allowed, e.g. "quantize.int4") as `model`.

    Raises QuantgateError if the file, the block or a field is missing or wrong.
    """
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise QuantgateError(
            f"{path}: must be a mapping of blocks (prepare, quantize, evaluate, ...); got {_got(data)}"
        )
    parts = key.split(".")
    for i, part in enumerate(parts):
        if i and not isinstance(data, dict):  # e.g. `evaluate: 3` read as evaluate.serve: say what is wrong with it
            parent = ".".join(parts[:i])
            got = _got(data)
            raise QuantgateError(f"{where(path, parent)}: {parent} must be a mapping (of {part}, ...); got {got}")
        if part not in data:
            raise QuantgateError(
                f"{path}: no block '{key}' (missing '{part}'); the comments in params.yaml describe every block"
            )
        data = data[part]
    return parse(model, data, str(path), path, tuple(parts))
