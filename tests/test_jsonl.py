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
