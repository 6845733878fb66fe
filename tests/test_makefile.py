"""The README's `make test` as make reads it (no set-up or test is run: `check-workers` has no prerequisite and
`make -n` only prints): a bad TEST_WORKERS stops it in one line before the set-up, not after 40 minutes of tests."""

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on PATH")


def make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


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
    planned = make("-n", "test", "TEST_WORKERS=3").stdout
    assert planned.index("TEST_WORKERS") < planned.index("scripts/setup.sh")
    unit = [line for line in planned.splitlines() if '-m "not e2e"' in line]
    assert len(unit) == 1 and "-n 3 --dist loadfile" in unit[0]
    assert "-n 3 --dist loadfile" in make("-n", "test-unit", "TEST_WORKERS=3").stdout
