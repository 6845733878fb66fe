"""Quiet stage output (quantgate/console.py): library output lands in results/logs/<stage>.log, the
stage's own lines on the terminal, and a failing stage shows its whole log."""

import logging
import os
import signal
import sys
import warnings

import pytest
from loguru import logger

from quantgate import console
from quantgate.errors import QuantgateError, run_main

# a print made from a project module (a stage's own line)
stage_print = eval("lambda *a, **k: print(*a, **k)", {"__name__": "pipeline.fake_stage"})


def library_noise():
    """What llm-compressor, transformers, datasets and C code do to a terminal."""
    warnings.warn("a library UserWarning", UserWarning, stacklevel=1)
    logging.getLogger("somelib").warning("a library logging line")
    sink = logger.add(sys.stdout, format="{message}")  # as llm-compressor adds its sink
    logger.info("Quantizing 7 module(s): ['model.layers.0.mlp.up_proj']")
    logger.remove(sink)
    print("a library print")
    print("a library print to stderr", file=sys.stderr)
    sys.stdout.flush()
    os.write(2, b"a C-level line\n")


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    handler = signal.getsignal(signal.SIGTERM)
    yield tmp_path
    signal.signal(signal.SIGTERM, handler)


NOISE = ("UserWarning", "a library logging line", "Quantizing 7", "a library print", "C-level")


def test_library_output_goes_to_the_log_and_the_stage_lines_to_the_terminal(in_tmp, capfd):
    def main():
        stage_print("fake: own line")
        library_noise()
        stage_print("fake: own error line", file=sys.stderr)

    run_main(main, log="fake@int4")
    out, err = capfd.readouterr()
    assert out.splitlines() == ["fake: own line", "fake[int4]: log results/logs/fake@int4.log"]
    assert err.splitlines() == ["fake: own error line"]
    log = (in_tmp / "results/logs/fake@int4.log").read_text()
    for line in NOISE:
        assert line in log
    assert "own line" not in log
    assert not isinstance(sys.stdout, console._Split)


def run_failing(exc: Exception, capfd, noisy: bool = True) -> tuple[int, str]:
    """Run a fake stage that makes library noise (if `noisy`) and raises `exc`: (exit code, terminal stderr)."""

    def main():
        if noisy:
            library_noise()
        raise exc

    with pytest.raises(SystemExit) as exit_:
        run_main(main, log="fake")
    return exit_.value.code, capfd.readouterr().err


def test_a_failing_stage_shows_its_whole_log_then_the_error(in_tmp, capfd):
    code, err = run_failing(QuantgateError("quantize.int4.group_size=48 does not divide 576"), capfd)
    assert code == 2
    assert "Traceback" not in err
    for line in NOISE:
        assert line in err
    assert err.splitlines()[0] == "---- results/logs/fake.log ----"
    assert err.splitlines()[-1] == "quantgate: error: quantize.int4.group_size=48 does not divide 576"


def test_an_error_with_an_empty_log_is_one_line(in_tmp, capfd):
    code, err = run_failing(QuantgateError("usage: python -m pipeline.fake BUILD"), capfd, noisy=False)
    assert (code, err) == (2, "quantgate: error: usage: python -m pipeline.fake BUILD\n")


def test_a_bug_shows_the_log_ending_with_its_traceback_and_exits_1(in_tmp, capfd):
    code, err = run_failing(KeyError("oops"), capfd)
    assert code == 1
    assert "a library logging line" in err and "KeyError: 'oops'" in err
    assert "KeyError: 'oops'" in (in_tmp / "results/logs/fake.log").read_text()


def test_log_progress_counts_matching_library_lines(in_tmp, monkeypatch, capfd):
    updates = []

    class Bar:
        def update(self, n=1):
            updates.append(n)

        def close(self):
            updates.append("closed")

    monkeypatch.setattr(console, "progress", lambda **kw: Bar())
    with console.stage_log("fake"):
        with console.log_progress(r"Quantizing (\d+) module", desc="GPTQ"):
            library_noise()
            library_noise()
    assert updates == [7, 7, "closed"]


def test_log_progress_with_a_real_bar_leaves_the_stage_alone(in_tmp, capfd):
    with console.stage_log("fake"):
        with console.log_progress(r"Quantizing (\d+) module", desc="GPTQ"):
            library_noise()
            library_noise()
    log = (in_tmp / "results/logs/fake.log").read_text()
    assert "Quantizing 7" in log and "error" not in log.lower()


def test_per_build_names_the_foreach_stage(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pipeline.quantize", "int4", "models/fp16", "models/int4"])
    assert console.per_build("quantize") == "quantize@int4"
    monkeypatch.setattr(sys, "argv", ["pipeline.quantize", "../x"])
    assert console.per_build("quantize") == "quantize@.._x"
