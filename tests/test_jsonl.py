"""The kernel's JSONL reader: values with their line numbers, and one-line errors naming file, line and fix."""

import pytest

from quantgate.errors import QuantgateError
from quantgate.jsonl import read_jsonl

FIX = "re-run the stage"


def test_values_with_line_numbers_blank_lines_skipped(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"a": 1}\n\n  \n[2, "é"]\r\n"a\u2028b"\n', encoding="utf-8")  # lines end at \n only
    assert read_jsonl(path, FIX) == [(1, {"a": 1}), (4, [2, "é"]), (5, "a\u2028b")]
    path.write_bytes(b"")
    assert read_jsonl(path, FIX) == []


@pytest.mark.parametrize(
    "raw, error",
    [
        (b'{"a": 1}\n{"a": \n', "2: invalid JSON (Expecting value at column 7)"),
        (b'{"a": 1}\n\n{"a": "caf\xe9"}\n', "3: not UTF-8 (byte 0xe9)"),
        (
            b'{"a": "\\ud800"}\n',
            "1: a string holds an unpaired surrogate (surrogates not allowed, e.g. \\ud800; "
            "quantgate's surrogate rule)",
        ),
        (b"[" * 100_000 + b"]" * 100_000 + b"\n", "1: JSON nested too deeply (quantgate's nesting rule)"),
    ],
)
def test_bad_line_is_one_line_naming_file_line_problem_and_fix(tmp_path, raw, error):
    path = tmp_path / "a.jsonl"
    path.write_bytes(raw)
    with pytest.raises(QuantgateError) as err:
        read_jsonl(path, FIX)
    assert str(err.value).startswith(f"{path}:{error}") and str(err.value).endswith(f"; {FIX}")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "raw, by_hand, loader, error",
    [
        (b'{"a": 1, "a": 2}\n', False, False, "1: key 'a' is given twice in one object; " + FIX),
        (b'{"a": 1, "a": 2}\n', True, False, "1: key 'a' is given twice in one object; keep one"),
        (
            b'{"a": 1, "a": 2}\n',
            True,
            True,
            "1: key 'a' is given twice in one object (the datasets loader lm-eval uses refuses such a file, or in a "
            "nested object keeps a wrong value); keep one",
        ),
        (
            b'{"a": NaN}\n',
            True,
            False,
            "1: NaN is not JSON (RFC 8259 has no NaN or Infinity; quantgate's no-NaN rule); write a number, a string "
            "or null",
        ),
        (
            b'{"a": NaN}\n',
            False,
            True,
            "1: NaN is not JSON (RFC 8259 has no NaN or Infinity; quantgate's no-NaN "
            "rule, stricter than the datasets loader); " + FIX,
        ),
        (b'{"a": \n', True, False, "1: invalid JSON (Expecting value at column 7); " + FIX),  # no fix of its own
    ],
)
def test_a_file_people_write_gets_each_lines_own_fix_and_the_loader_only_where_it_reads(
    tmp_path, raw, by_hand, loader, error
):
    """calibration.jsonl's key given twice said "(the datasets loader lm-eval uses refuses such a file ...); save it
    as UTF-8": lm-eval never reads that file, and the caller's advice replaced the line's own fix."""
    path = tmp_path / "a.jsonl"
    path.write_bytes(raw)
    with pytest.raises(QuantgateError) as err:
        read_jsonl(path, FIX, by_hand=by_hand, loader=loader)
    assert str(err.value) == f"{path}:{error}"


def test_a_file_that_cannot_be_read_is_one_line_not_a_traceback(tmp_path):
    """A folder where a file should be (as an unreadable file, for a user without root) is named, with why."""
    from quantgate.hashing import sha256_file

    folder = tmp_path / "calibration.jsonl"
    folder.mkdir()
    with pytest.raises(QuantgateError) as err:
        read_jsonl(folder, "save it as UTF-8")
    assert str(err.value) == f"{folder}: cannot read it (Is a directory); save it as UTF-8"
    with pytest.raises(QuantgateError) as err:
        sha256_file(folder)
    assert str(err.value) == f"{folder}: cannot read it (Is a directory); check that it is a file you can read"


@pytest.mark.parametrize(
    "raw, loader, error",
    [
        (
            b'{"a": 1}\r{"a": 2}\r',
            False,
            "1: the file's line ends are CR only (old Mac style); save the file with LF or CRLF line ends",
        ),
        (
            b'{"a": 1}\r{"a": 2}\r',
            True,
            "1: the file's line ends are CR only (old Mac style; the datasets loader lm-eval uses reads them, "
            "quantgate's line rules do not); save the file with LF or CRLF line ends",
        ),
        (
            b'{"a": 1}\n{"a": 2}\r{"a": 3}\n',
            False,
            "2: a CR line end (U+000D, old Mac style) before column 10 starts a second JSON value on the line "
            "(quantgate's one-object-per-line rule reads LF or CRLF line ends); end the line with LF or CRLF",
        ),
        (
            b'{"a": 1}\x0c\n',
            True,
            "1: a form feed (U+000C) after the JSON value (at column 9; not JSON whitespace: the datasets loader "
            "lm-eval uses refuses it too); remove it",
        ),
        (
            b'{"a": 1}\n\xe2\x80\xa8 {"a": 2}\n',
            False,
            "2: a line separator (U+2028) before the JSON value (at column 1; not JSON whitespace); remove it",
        ),
        (
            b'{"a":\xc2\xa01}\n',
            False,
            "1: a no-break space (U+00A0) inside the JSON value (at column 6; not JSON whitespace); remove it",
        ),
        (b'{"a": 1}\x0c{"a": 2}\n', False, "1: more than one JSON value on the line (at column 9; quantgate's"),
        (  # too deep for json to tell whether it is one value: a RecursionError traceback before
            b"[" * 100_000 + b"\r" + b"]" * 100_000,
            False,
            "1: the file's line ends are CR only (old Mac style); save the file with LF or CRLF line ends",
        ),
    ],
)
def test_cr_only_line_ends_and_stray_spaces_are_named_not_taken_for_two_values(tmp_path, raw, loader, error):
    """A file with old-Mac CR-only line ends, and a form feed after a line's value, were both told "more than one
    JSON value on the line": the file's line ends, and the character (it is no JSON whitespace), are named now."""
    path = tmp_path / "a.jsonl"
    path.write_bytes(raw)
    with pytest.raises(QuantgateError) as err:
        read_jsonl(path, FIX, by_hand=True, loader=loader)
    assert str(err.value).startswith(f"{path}:{error}")


def test_crlf_line_ends_and_a_last_line_ending_in_cr_are_still_read(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"a": 1}\r\n{"a": 2}\r\n')
    assert read_jsonl(path, FIX) == [(1, {"a": 1}), (2, {"a": 2})]
    path.write_bytes(b'{"a": 1}\r')  # one line, ended in CR: nothing to split
    assert read_jsonl(path, FIX) == [(1, {"a": 1})]
    path.write_bytes(b'{"q":\r"a", "n": 1}')  # one document, a CR as JSON whitespace in it: no CR line ends
    assert read_jsonl(path, FIX) == [(1, {"q": "a", "n": 1})]
