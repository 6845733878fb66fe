"""JSON Lines files (one JSON value per line, UTF-8): the project's one reader and its line rules.

`read_jsonl` stops at the first bad line with one error, `<path>:<line>: <problem>; <what to do>`: for a file
a stage writes, the caller says what to do (re-run the stage); for one people write (`by_hand`), the line says
its own fix (keep one of a key given twice), the caller's only where the line has none. Team data files go
through checks.read_docs, which applies the same rules (`lines_of`, `parse_line`) but lists every bad line at
once. Only where lm-eval's datasets loader reads the file (`loader`: a team's data files) do the messages
compare the rules with that loader's.
"""

from __future__ import annotations

import codecs
import json
import unicodedata
from pathlib import Path

from quantgate.errors import QuantgateError


class BadLine(ValueError):
    """Line `number` of a JSONL file is not a JSON value: `problem` says what is wrong, `fix` what to do
    when the data alone say it (empty otherwise)."""

    def __init__(self, number: int, problem: str, fix: str = "") -> None:
        super().__init__(f"{number}: {problem}")
        self.number, self.problem, self.fix = number, problem, fix

    def at(self, path: Path, fix: str = "") -> str:
        """The one-line error for the file at `path`, with `fix` (or this line's own fix, if any)."""
        fix = fix or self.fix
        return f"{path}:{self.number}: {self.problem}" + (f"; {fix}" if fix else "")


def decode(raw: bytes) -> str:
    """`raw` as UTF-8, less a leading byte-order mark (some Windows editors write one; the datasets JSON loader
    that lm-eval uses skips it too). Raises BadLine at the line of the first byte that is not UTF-8."""
    raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        number = raw[: exc.start].count(b"\n") + 1
        raise BadLine(number, f"not UTF-8 (byte 0x{raw[exc.start]:02x})", "save the file as UTF-8") from None


def lines_of(raw: bytes, loader: bool = False) -> list[str]:
    """The lines of a JSONL file's bytes `raw` (decode), split at LF: a CRLF's CR is JSON whitespace, left for the
    parser. Raises BadLine at line 1 for a file whose line ends are CR only (old Mac style), which would read as
    one line; with `loader`, saying that lm-eval's datasets loader reads CR as a line end (quantgate does not)."""
    text = decode(raw)
    if "\n" not in text and "\r" in text.strip() and not _one_value(text):  # CR as JSON whitespace: one document
        than = "; the datasets loader lm-eval uses reads them, quantgate's line rules do not" if loader else ""
        raise BadLine(
            1,
            f"the file's line ends are CR only (old Mac style{than})",
            "save the file with LF or CRLF line ends",
        )
    return text.split("\n")


def _one_value(text: str) -> bool:
    """Whether `text` is one JSON value (its CRs JSON whitespace inside or around it), not several lines."""
    try:
        json.loads(text)
    except (ValueError, RecursionError):  # deep nesting: parse_line names it on the line
        return False
    return True


_CHAR_NAMES = {"\x0b": "a vertical tab", "\x0c": "a form feed", "\x85": "a next-line control (NEL)"}


def _stray(ch: str) -> str | None:
    """`ch` named with its code point (`a form feed (U+000C)`) if it is a space, line end or invisible character
    that JSON does not take for whitespace (JSON's are space, tab, CR and LF only); None for any other."""
    if (
        len(ch) != 1
        or ch in " \t\r\n"
        or not (ch.isspace() or unicodedata.category(ch) in ("Cc", "Cf", "Zs", "Zl", "Zp"))
    ):
        return None
    name = _CHAR_NAMES.get(ch) or unicodedata.name(ch, "control character").lower()
    article = "" if name.startswith("a ") else ("an " if name[0] in "aeiou" else "a ")
    return f"{article}{name} (U+{ord(ch):04X})"


def _decode_error(number: int, line: str, exc: json.JSONDecodeError, loader: bool) -> BadLine:
    """The BadLine for json's error `exc` on line `number`: a character JSON does not take for whitespace named
    (a form feed after the value), a bare CR inside the line named as a line end, two values on the line, or
    json's own words."""
    at, rest = line[exc.pos : exc.pos + 1], line[exc.pos :]
    too = ": the datasets loader lm-eval uses refuses it too" if loader else ""
    if exc.msg == "Extra data" and (name := _stray(at)) and all(_stray(c) or c.isspace() for c in rest):
        return BadLine(
            number, f"{name} after the JSON value (at column {exc.colno}; not JSON whitespace{too})", "remove it"
        )
    if exc.msg != "Extra data" and (name := _stray(at)):
        where = "before" if not line[: exc.pos].strip(" \t\r\n") else "inside"
        return BadLine(
            number, f"{name} {where} the JSON value (at column {exc.colno}; not JSON whitespace{too})", "remove it"
        )
    gap = line[: exc.pos]
    if exc.msg == "Extra data" and "\r" in gap[len(gap.rstrip(" \t\r\n")) :]:
        # `{...}\r{...}`: an old Mac line end inside an LF-ended line, which the datasets loader reads as a line end
        return BadLine(
            number,
            f"a CR line end (U+000D, old Mac style) before column {exc.colno} starts a second JSON value on the line "
            "(quantgate's one-object-per-line rule reads LF or CRLF line ends)",
            "end the line with LF or CRLF",
        )
    if exc.msg == "Extra data":  # `{...}{...}`: the datasets loader would read two documents from one line
        return BadLine(
            number,
            f"more than one JSON value on the line (at column {exc.colno}; quantgate's one-object-per-line rule)",
            "put each document on its own line",
        )
    # "Unterminated string starting at" names its position itself
    return BadLine(number, f"invalid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})")


def _unique_keys(number: int, loader: bool):
    """json's object_pairs_hook refusing a key given twice in one object (json keeps the last silently); with
    `loader`, saying what lm-eval's datasets loader would do with it."""

    def pairs(items: list[tuple[str, object]]) -> dict:
        out: dict = {}
        for key, value in items:
            if key in out:
                why = (
                    " (the datasets loader lm-eval uses refuses such a file, or in a nested object keeps a wrong value)"
                    if loader
                    else ""
                )
                raise BadLine(number, f"key {key!r} is given twice in one object{why}", "keep one")
            out[key] = value
        return out

    return pairs


def parse_line(number: int, line: str, loader: bool = False) -> object:
    """The JSON value of line `number`. Raises BadLine if it is not JSON (NaN and Infinity, which Python's json
    reads, are not JSON: RFC 8259 section 6), is nested too deeply for the parser, holds an unpaired
    surrogate (`"\\ud800"`: json reads it, but no UTF-8 writer or dataset loader does), or gives a key twice
    in one object. Each of these names its rule (evals/README.md); with `loader` (a file lm-eval's datasets
    loader reads: a team's data file) the messages say how the rule compares with that loader."""

    def not_json(name: str):
        than = ", stricter than the datasets loader" if loader else ""
        raise BadLine(
            number,
            f"{name} is not JSON (RFC 8259 has no NaN or Infinity; quantgate's no-NaN rule{than})",
            "write a number, a string or null",
        )

    try:
        value = json.loads(line, parse_constant=not_json, object_pairs_hook=_unique_keys(number, loader))
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except json.JSONDecodeError as exc:
        raise _decode_error(number, line, exc, loader) from None
    except RecursionError:
        raise BadLine(number, "JSON nested too deeply (quantgate's nesting rule)", "flatten the document") from None
    except UnicodeEncodeError as exc:
        raise BadLine(
            number,
            f"a string holds an unpaired surrogate ({exc.reason}, e.g. \\ud800; quantgate's surrogate rule)",
            "write real characters",
        ) from None
    return value


def read_jsonl(path: Path, what_to_do: str, by_hand: bool = False, loader: bool = False) -> list[tuple[int, object]]:
    """(line number, value) of every line of the JSONL file at `path`; blank lines are skipped.

    Raises QuantgateError in one line, `<path>:<line>: <problem>; <fix>`, at the first byte that is not UTF-8
    or the first line that is not JSON (parse_line, `loader` passed on), and `<path>: cannot read it (<why>);
    <what_to_do>` for a file that cannot be read (permissions, a folder). The fix is `what_to_do` for a file a
    stage writes (re-run it: the line's own fix would have the user edit an output); for one people write
    (`by_hand`, e.g. a team's calibration.jsonl) it is the line's own (BadLine.fix: keep one of a key given
    twice, write a number for NaN), and `what_to_do` only for a line without one (invalid JSON).
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise QuantgateError(f"{path}: cannot read it ({exc.strerror or type(exc).__name__}); {what_to_do}") from None
    try:
        lines = lines_of(data, loader)
        return [(number, parse_line(number, line, loader)) for number, line in enumerate(lines, 1) if line.strip()]
    except BadLine as exc:
        raise QuantgateError(exc.at(path, (exc.fix or what_to_do) if by_hand else what_to_do)) from None
