"""quantgate/scratch.py: a scratch folder whose owner was SIGKILLed is swept by the next one made."""

import os
import subprocess
import sys

from quantgate.scratch import alive, scratch_dir, sweep


def dead_pid() -> int:
    """The id of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_dead_owners_folder_is_swept_and_a_live_owners_kept(tmp_path):
    gone = tmp_path / f"quantgate-task-{dead_pid()}-abc"
    gone.mkdir()
    (gone / "server.log").write_text("left by a SIGKILLed task")
    mine = scratch_dir("quantgate-task-", tmp_path)
    assert mine.name.startswith(f"quantgate-task-{os.getpid()}-") and mine.is_dir()
    assert not gone.exists()
    assert mine.exists()  # its owner (this process) is alive
    assert sweep("quantgate-task-", tmp_path) == []


def test_other_prefixes_and_files_are_left_alone(tmp_path):
    pid = dead_pid()
    other = tmp_path / f"quantgate-vllm-ipc-{pid}-x"
    other.mkdir()
    plain = tmp_path / f"quantgate-task-{pid}-file"
    plain.write_text("a file, not a folder")
    unnamed = tmp_path / "quantgate-task-abc"  # no pid: not one of ours
    unnamed.mkdir()
    assert sweep("quantgate-task-", tmp_path) == []
    assert other.exists() and plain.exists() and unnamed.exists()
    assert sweep("quantgate-vllm-ipc-", tmp_path) == [other]


def test_alive():
    assert alive(os.getpid())
    assert not alive(dead_pid())
