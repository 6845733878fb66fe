"""The sandbox every team template is rendered in, at validation and at evaluation alike.

A team's task YAML carries Jinja templates (doc_to_text, doc_to_target, doc_to_choice,
description, gen_prefix). lm-eval renders them with `lm_eval.utils.apply_template`, which
compiles them in the plain module-level `jinja2.Environment` `lm_eval.utils.env`: there a
template reaches Python itself (`{{ cycler.__init__.__globals__.os.popen('id').read() }}`).

- `ENV`: Jinja's ImmutableSandboxedEnvironment with lm-eval's settings (StrictUndefined,
  trailing newline kept, its `regex_replace` filter) and only the globals a prompt needs
  (`range`, at most MAX_RANGE items, and `dict`). Attributes starting with `_`, functions'
  internals and mutating methods raise jinja2.sandbox.SecurityError; so do `*` and `**`
  results over the size limits. `render` is lm-eval's `apply_template` in it.
- `lm_eval_sandboxed()`: lm-eval's own rendering uses `ENV` inside it (the evaluate stage
  runs lm-eval there). tests/test_sandbox.py pins the lm-eval internals this relies on.
- `unsafe_parts`: what a template's syntax tree reaches, found even when no document takes
  that branch (validation reports both this and the sandbox's verdict on every document).
- `time_limit`: bounds a render in wall time (validation renders every document in it).
- `slow_regex`: times a team's regular expression on inputs built to make backtracking blow
  up, in a child process that is killed at the limit.
"""

from __future__ import annotations

import re
import signal
import string
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from jinja2 import StrictUndefined, Template, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

MAX_RANGE = 1000  # items a template's range() may make (Jinja's own sandbox allows 100000)
MAX_SIZE = 1_000_000  # characters (or items) a `*` may make, and a rendered template may have
MAX_BITS = 100_000  # largest integer a `**` may make (bits)
MAX_EXPONENT = 100  # largest exponent of `**`
RENDER_SECONDS = 2.0  # wall time validation gives one document's templates
REGEX_SECONDS = 2.0  # wall time a regular expression gets on all the probe inputs
PROBE_LENGTH = 1000  # characters of the longest probe input (a long model answer)

# Names a template could use to reach Jinja's or a web framework's objects rather than the
# document's fields: Jinja's default globals, the template itself, Flask's context objects.
FORBIDDEN_NAMES = frozenset(
    {
        "cycler",
        "joiner",
        "namespace",
        "lipsum",
        "self",
        "config",
        "request",
        "url_for",
        "get_flashed_messages",
        "caller",
        "varargs",
        "kwargs",
    }
)


class RenderTimeout(Exception):
    """A template took longer than its time limit to render."""


class TooLong(SecurityError):
    """A template rendered more than MAX_SIZE characters for one document: a long document (or a template that
    repeats one) is that document's problem, not an unsafe template."""


_deadline = threading.local()


def _tick() -> None:
    at = getattr(_deadline, "at", None)
    if at is not None and time.monotonic() > at:
        raise RenderTimeout(f"over {_deadline.seconds:g} s")


class _Sandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment that also bounds sizes and checks the render deadline."""

    intercepted_binops = frozenset({"*", "**", "%"})

    def call_binop(self, context, operator, left, right):
        _tick()
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise SecurityError(f"exponent {right} is over the sandbox's {MAX_EXPONENT}")
        if (
            operator == "**"
            and isinstance(left, int)
            and isinstance(right, int)
            and abs(left) > 1
            and (left.bit_length() * right > MAX_BITS)
        ):  # big-number arithmetic cannot be interrupted by the time limit
            raise SecurityError(f"a power of over {MAX_BITS} bits, over the sandbox's limit")
        if operator == "%" and isinstance(left, str):
            _check_str_method("%", left, (right,))
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_SIZE:
                    raise SecurityError(f"`*` would make {len(seq) * n} items, over the sandbox's {MAX_SIZE}")
        return super().call_binop(context, operator, left, right)

    def getattr(self, obj, attribute):
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _tick()
        return super().getitem(obj, argument)

    def call(__self, __context, __obj, *args, **kwargs):  # Jinja's own signature
        _tick()
        # str methods that size their result; Jinja hands str.format over wrapped (wrap_str_format), not bound
        method = getattr(__obj, "__wrapped__", __obj)
        if isinstance(getattr(method, "__self__", None), str):
            _check_str_method(method.__name__, method.__self__, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


def _check_str_method(name: str, text: str, args: tuple, kwargs: dict | None = None) -> None:
    """Refuse a str.format/format_map/replace/join/center/... call, or `%` formatting (name "%", args
    (its right operand,)), whose result would be over MAX_SIZE (memory is taken before the result could be
    measured). Field widths and precisions are summed over the whole format string, nested ones ('{0:{1}}',
    '%*s') read from the arguments, so '{0:999999}' * 100 counts as 99,999,900 characters; digits in the
    literal text do not count."""
    if name in ("format", "format_map", "%"):
        if name == "%":
            size = _percent_size(text, args[0] if args else ())
        else:
            mapping = args[0] if name == "format_map" and args else (kwargs or {})
            size = _format_size(text, () if name == "format_map" else args, mapping)
        if size > MAX_SIZE:
            raise SecurityError(f"the format widths in {text[:40]!r} add up to over the sandbox's {MAX_SIZE}")
    if name == "join" and args and hasattr(args[0], "__len__") and len(args[0]) * len(text) > MAX_SIZE:
        raise SecurityError(f"join would make more characters than the sandbox's {MAX_SIZE}")
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = len(text) + 1 if not args[0] else text.count(args[0])
        if count * len(args[1]) + len(text) > MAX_SIZE:
            raise SecurityError(f"replace would make more characters than the sandbox's {MAX_SIZE}")
    if any(isinstance(a, int) and not isinstance(a, bool) and a > MAX_SIZE for a in args):
        raise SecurityError(f"str.{name} with a size over the sandbox's {MAX_SIZE}")


_FORMATTER = string.Formatter()
# a str.format spec's width and precision (https://docs.python.org/3/library/string.html#format-specification-mini-language)
_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(?P<width>\d*)[,_]?(?:\.(?P<precision>\d+))?")
# a printf-style conversion (https://docs.python.org/3/library/stdtypes.html#printf-style-string-formatting)
_PERCENT = re.compile(
    r"%(?:\((?P<key>[^)]*)\))?[#0\- +]*(?P<width>\*|\d+)?(?:\.(?P<precision>\*|\d+))?[hlL]?(?P<type>[^hlL])"
)


def _number(digits: str) -> int:
    """The int of a run of digits, any run longer than MAX_SIZE's counted as over it (int() of 4300+ digits raises)."""
    return int(digits) if len(digits) <= len(str(MAX_SIZE)) else MAX_SIZE + 1


def _format_size(text: str, args: tuple, kwargs) -> int:
    """Characters str.format's field widths and precisions in `text` ask for, nested fields resolved from
    `args`/`kwargs` (auto-numbered ones in str.format's order); 0 for a malformed string (str.format raises).
    Raises SecurityError for a nested field that is not a plain index or name, or an index of over 7 digits."""
    try:
        fields = list(_FORMATTER.parse(text))
    except ValueError:
        return 0
    auto, total = 0, 0
    for _literal, name, spec, _conversion in fields:
        if name is None:
            continue
        if name == "":
            auto += 1
        if "{" in (spec or ""):
            resolved = []
            for literal, inner, _s, _c in _FORMATTER.parse(spec):
                resolved.append(literal)
                if inner is None:
                    continue
                if inner == "":
                    inner, auto = str(auto), auto + 1
                if not inner.isidentifier() and not (inner.isascii() and inner.isdigit()):
                    raise SecurityError(f"a nested format field {{{inner}}}: give a plain index or name")
                if inner.isdigit() and len(inner) > len(str(MAX_SIZE)):  # int() of 4300+ digits raises
                    raise SecurityError(
                        f"a nested format field index of {len(inner)} digits ({{{inner[:12]}...}}): give the index "
                        "of one of the format's arguments"
                    )
                value = args[int(inner)] if inner.isdigit() and int(inner) < len(args) else None
                if not inner.isdigit():
                    value = kwargs.get(inner) if hasattr(kwargs, "get") else None
                resolved.append(str(value))
            spec = "".join(resolved)
        if m := _SPEC.match(spec or ""):
            total += sum(_number(m[part]) for part in ("width", "precision") if m[part])
    return total


def _percent_size(text: str, values) -> int:
    """Characters `text % values`'s widths and precisions ask for ('*' read from `values`)."""
    positional = values if isinstance(values, tuple) else (values,)
    used, total = 0, 0
    for m in _PERCENT.finditer(text):
        if m["type"] == "%":
            continue
        for part in ("width", "precision"):
            if m[part] == "*":
                n = positional[used] if used < len(positional) else 0
                used += 1
                total += abs(n) if isinstance(n, int) and not isinstance(n, bool) else 0
            elif m[part]:
                total += _number(m[part])
        used += m["key"] is None
    return total


def _sized(name: str, flt):
    """Filter `flt` refusing sizes over MAX_SIZE before it allocates them (center(10**9), batch(10**9),
    '%0999999999d'|format, replace('', huge)): Jinja's sandbox bounds none of these."""

    def checked(*args, **kwargs):
        _tick()
        values = [*args, *kwargs.values()]
        if any(isinstance(a, int) and not isinstance(a, bool) and a > MAX_SIZE for a in values):
            raise SecurityError(f"filter {name} with a size over the sandbox's {MAX_SIZE}")
        text = next((a for a in args if isinstance(a, str)), None)  # the value (context filters get it 2nd)
        if text is not None and name in ("format", "replace"):
            rest = list(args[args.index(text) + 1 :])
            if name == "format":  # Jinja's format filter is printf-style: value % (kwargs or args)
                _check_str_method("%", text, (kwargs or tuple(rest),))
            else:
                _check_str_method(name, text, tuple(rest))
        seqs = [a for a in args if isinstance(a, (str, list, tuple))]
        if name == "join" and len(seqs) >= 2 and isinstance(seqs[1], str):  # value|join(separator)
            _check_str_method("join", seqs[1], (seqs[0],))
        return flt(*args, **kwargs)

    for attr in ("jinja_pass_arg",):  # keep Jinja's pass_context/pass_environment marks
        if hasattr(flt, attr):
            setattr(checked, attr, getattr(flt, attr))
    return checked


def regex_replace(string, pattern, repl, count: int = 0):
    """lm-eval's `regex_replace` template filter (lm_eval/utils.py): `re.sub` as a filter."""
    return re.sub(pattern, repl, string, count=count)


def _range(*args) -> range:
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise SecurityError(f"range of {len(r)} items is over the sandbox's {MAX_RANGE}")
    return r


def _dict(*args, **kwargs) -> dict:
    """`dict(...)` for templates: a function, so `dict.update(doc_field, ...)` (the class's unbound
    methods, which mutate past the immutable sandbox) does not exist."""
    return dict(*args, **kwargs)


class _TimedTemplate(Template):
    """A template whose render is bounded by RENDER_SECONDS unless a longer limit is already set:
    lm-eval's rendering at evaluation gets the same bound as validation."""

    def render(self, *args, **kwargs):
        if getattr(_deadline, "at", None) is not None:
            return super().render(*args, **kwargs)
        with time_limit():
            return super().render(*args, **kwargs)


ENV = _Sandbox(undefined=StrictUndefined, keep_trailing_newline=True)
ENV.template_class = _TimedTemplate
ENV.filters["regex_replace"] = regex_replace
ENV.filters.update({name: _sized(name, f) for name, f in ENV.filters.items()})
ENV.globals.clear()
ENV.globals.update(range=_range, dict=_dict)


@lru_cache(maxsize=512)
def compile_template(source: str) -> Template:
    """`source` compiled in the sandbox (cached: validation renders one template per document)."""
    return ENV.from_string(source)


def render(source: str, doc: dict) -> str:
    """lm-eval's `apply_template(source, doc)` in the sandbox.

    Raises jinja2.sandbox.SecurityError on anything the sandbox refuses (a rendered text over
    MAX_SIZE characters included), RenderTimeout past a `time_limit`, and whatever the template
    raises on this document (jinja2.UndefinedError for a missing field, ValueError, ...).
    """
    text = compile_template(source).render(**doc)
    if len(text) > MAX_SIZE:
        raise TooLong(f"renders {len(text):,} characters, over the {MAX_SIZE:,} a rendered text may have")
    return text


@contextmanager
def time_limit(seconds: float | None = None) -> Iterator[None]:
    """Raise RenderTimeout in the block once `seconds` (default RENDER_SECONDS) have passed.

    The sandbox checks the deadline on every attribute, item, call and `*`/`**`; in the main
    thread a SIGALRM timer also interrupts loops that do none of these.
    """
    seconds = RENDER_SECONDS if seconds is None else seconds
    _deadline.at, _deadline.seconds = time.monotonic() + seconds, seconds
    timer = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    if timer:

        def expired(signum, frame):
            raise RenderTimeout(f"over {seconds:g} s")

        previous = signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        _deadline.at = None
        if timer:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


@contextmanager
def lm_eval_sandboxed() -> Iterator[None]:
    """Make lm-eval render every template with `ENV` inside the block.

    `lm_eval.utils.apply_template` compiles with the module attribute `lm_eval.utils.env`, and
    lm-eval's tasks call it through the module (`utils.apply_template`) for doc_to_text,
    doc_to_target, doc_to_choice, description and gen_prefix: swapping that one attribute
    sandboxes them all. tests/test_sandbox.py fails if a new lm-eval stops working this way.
    """
    import lm_eval.utils

    plain = lm_eval.utils.env
    lm_eval.utils.env = ENV
    try:
        yield
    finally:
        lm_eval.utils.env = plain


def _findings(tree: nodes.Template) -> list[tuple[str, str]]:
    """What a parsed template reaches past the document, as (kind, item) in reading order:
    ("name", a FORBIDDEN_NAMES name), ("internal", an attribute or key), ("other", a reason)."""
    found = []
    for node in reversed(list(tree.find_all(nodes.Node))):  # find_all visits an expression outside-in
        if isinstance(node, nodes.Getattr) and node.attr.startswith("_"):
            found.append(("internal", node.attr))
        elif (
            isinstance(node, nodes.Getitem)
            and isinstance(node.arg, nodes.Const)
            and isinstance(node.arg.value, str)
            and node.arg.value.startswith("_")
        ):
            found.append(("internal", node.arg.value))
        elif isinstance(node, nodes.Const) and isinstance(node.value, str) and "__" in node.value:
            # a dunder spelled in a string: '__cla' ~ 'ss__', '{0.__class__}'.format, map(attribute='__class__')
            found.append(("internal", node.value))
        elif isinstance(node, nodes.Name) and node.name in FORBIDDEN_NAMES:
            found.append(("name", node.name))
        elif isinstance(node, (nodes.Filter, nodes.Test)) and node.name == "attr":
            found.append(("other", "the `attr` filter reads attributes by name (write `x.name`)"))
        elif isinstance(node, (nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)):
            word = type(node).__name__.lower().replace("fromimport", "from")
            found.append(("other", f"`{word}` loads other templates (write the template out in full)"))
        elif isinstance(node, nodes.Filter) and node.name == "regex_replace":
            pattern = node.args[0] if node.args else None
            if not (isinstance(pattern, nodes.Const) and isinstance(pattern.value, str)):
                found.append(("other", "regex_replace needs a literal pattern (a quoted string)"))
            elif slow := slow_regex(pattern.value):
                found.append(("other", f"regex_replace pattern {pattern.value!r} {slow}"))
    return list(dict.fromkeys(found))


def _why(findings: list[tuple[str, str]]) -> str:
    """Findings as one reason: "'cycler' is a Jinja or Python object, not a document field;
    attributes '__init__', '__globals__' reach Python internals"."""
    names = [repr(item) for kind, item in findings if kind == "name"]
    internals = [repr(item) for kind, item in findings if kind == "internal"]
    reasons = []
    if names:
        reasons.append(
            f"{', '.join(names)} "
            + (
                "is a Jinja or Python object, not a document field"
                if len(names) == 1
                else "are Jinja or Python objects, not document fields"
            )
        )
    if internals:
        reasons.append(
            f"attribute {internals[0]} reaches Python internals"
            if len(internals) == 1
            else f"attributes {', '.join(internals)} reach Python internals"
        )
    return "; ".join(reasons + [item for kind, item in findings if kind == "other"])


def _blocks(source: str) -> list[str]:
    """The `{{ ... }}` and `{% ... %}` blocks of a template, in order."""
    return [m.group(0) for m in re.finditer(r"\{\{.*?\}\}|\{%.*?%\}", source, re.S)]


def _parse_alone(block: str) -> nodes.Template | None:
    """One block parsed on its own (a statement that opens a body closed by its end tag), or None."""
    tag = block[2:-2].strip("-+ \n\t").split(" ")[0]
    for text in (block, f"{block}{{% end{tag} %}}"):
        try:
            return ENV.parse(text)
        except Exception:  # a block that only parses in context (else, endfor, ...)
            continue
    return None


def unsafe_parts(source: str) -> list[tuple[str, str]]:
    """What in template `source` reaches past the document, as [(expression, why)].

    Refused: an attribute or constant key starting with `_` (Python internals), the names in
    FORBIDDEN_NAMES, the `attr` filter (a way to spell attributes as strings), include, import
    and extends, and a `regex_replace` whose pattern is not a literal or is slow (slow_regex).
    Each `{{ }}` or `{% %}` block is judged on its own, so the expression is the one at fault;
    a reason no single block shows is given with the whole template. Raises
    jinja2.TemplateSyntaxError if `source` does not parse.
    """
    whole = _findings(ENV.parse(source))  # raw blocks and comments are text here, not code
    found, seen = [], set()
    for block in _blocks(source):
        tree = _parse_alone(block)
        if tree is not None and (findings := [f for f in _findings(tree) if f in whole]):
            found.append((expression(block), _why(findings)))
            seen.update(findings)
    if missed := [f for f in whole if f not in seen]:
        found.append((expression(source), _why(missed)))
    return list(dict.fromkeys(found))


def expression(source: str, needle: str | None = None, width: int = 200) -> str:
    """The `{{ ... }}` or `{% ... %}` of template `source` that holds `needle` (the whole
    template when there is no needle or no such block), on one line, at most `width` characters."""
    text = " ".join(next((b for b in _blocks(source) if needle and needle in b), source).split())
    return text if len(text) <= width else text[: width - 3] + "..."


# Runs in a child (`python -I -S -c PROBE pattern n`): findall on inputs made of the pattern's own
# characters (and pairs of them, and its literal runs: (ab)+ repeats "ab") repeated and ended by one it
# cannot match, on which nested or overlapping repeats ((a+)+, ((ab)+)+, (a|b|ab)*, (\d+\.?\d*)*)
# backtrack without end. Short inputs after every prefix character
# find exponential blow-up behind a literal (x(a+)+y); long ones find high-degree polynomial blow-up.
PROBE = r"""
import re, sys
pattern, n = sys.argv[1], int(sys.argv[2])
p = re.compile(pattern)
chars = sorted({c for c in pattern if c.isprintable()} | set("a0 .,-"))
units = chars + [a + b for a in chars for b in chars] + re.findall(r"[A-Za-z0-9 ]{2,4}", pattern)
for first in [""] + chars:
    for u in units:
        p.findall(first + u * (60 // len(u) + 1) + "\x00")
for c in chars:
    p.findall(c * n + "\x00")
"""


@lru_cache(maxsize=256)
def slow_regex(pattern: str, seconds: float = REGEX_SECONDS) -> str | None:
    """Why regular expression `pattern` is refused ("is not a valid ...", "takes over ..."), or None.

    `pattern` is compiled with `re` (as lm-eval does), then matched on probe inputs in a child
    process that is killed after `seconds`: catastrophic backtracking hangs only that child.
    """
    try:
        re.compile(pattern)
    except re.error as exc:
        return f"is not a valid regular expression ({exc})"
    try:
        subprocess.run(
            [sys.executable, "-I", "-S", "-c", PROBE, pattern, str(PROBE_LENGTH)],
            timeout=seconds,
            capture_output=True,
            check=True,
        )
    except subprocess.TimeoutExpired:
        return (
            f"takes over {seconds:g} s on an input of at most {PROBE_LENGTH} characters (catastrophic "
            "backtracking, e.g. a repeat inside a repeat like (a+)+); simplify it"
        )
    except subprocess.CalledProcessError as exc:
        return f"fails on a probe input ({exc.stderr.decode(errors='replace').strip().splitlines()[-1:]})"
    return None
