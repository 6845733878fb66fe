"""quantgate.files: write_whole, the one way quantgate writes a file that others may read meanwhile, and not_to_open."""

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from quantgate.errors import QuantgateError
from quantgate.files import not_to_open, write_whole


def test_writers_in_threads_side_by_side_each_leave_a_whole_file(tmp_path):
    """A fleet starts servers from threads of one process, and each may write the probe's cache: with one temporary
    name per process, one thread's rename took the other's file away (FileNotFoundError) or wrote its half."""
    cache = tmp_path / "answer.json"
    texts = [json.dumps({"writer": i, "pad": "x" * 200_000}) for i in range(4)]

    def write(i: int) -> None:
        for _ in range(50):
            write_whole(cache, texts[i])

    with ThreadPoolExecutor(4) as pool:
        for done in [pool.submit(write, i) for i in range(4)]:
            done.result()
    assert cache.read_text() in texts
    assert [p.name for p in tmp_path.iterdir()] == ["answer.json"]


def test_keeps_permissions_and_a_symlinks_target(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("old\n")
    os.chmod(readme, 0o600)
    write_whole(readme, "new\n")
    assert readme.read_text() == "new\n" and readme.stat().st_mode & 0o777 == 0o600
    link = tmp_path / "link.md"
    link.symlink_to(readme)
    write_whole(link, "through the link\n")
    assert link.is_symlink() and readme.read_text() == "through the link\n"


def test_bad_paths_are_one_line_errors_and_leave_nothing_behind(tmp_path):
    (tmp_path / "adir").mkdir()
    with pytest.raises(QuantgateError, match="adir: is a folder; give a file path"):
        write_whole(tmp_path / "adir", "x")
    with pytest.raises(QuantgateError, match=r"missing/a.json: folder .*missing does not exist; create it"):
        write_whole(tmp_path / "missing" / "a.json", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]
    (tmp_path / "afile").write_text("kept\n")
    with pytest.raises(QuantgateError, match=r"afile/a.json: .*afile is a file, not a folder; give another path"):
        write_whole(tmp_path / "afile" / "a.json", "x")
    assert (tmp_path / "afile").read_text() == "kept\n"


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "record.json"
    path.write_text("old\n")
    with pytest.raises(UnicodeEncodeError):
        write_whole(path, "half \ud800")  # a lone surrogate cannot be written as UTF-8
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]


def test_a_device_or_fifo_is_refused_not_replaced(tmp_path):
    """Renaming over /dev/null as root replaced the device with a regular file; a FIFO stands in for it."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(QuantgateError, match="fifo: not a regular file"):
        write_whole(fifo, "x")
    assert fifo.is_fifo()  # (not tried on /dev/null: a regression would replace the machine's)


def test_a_symlink_loop_and_a_long_name_are_handled(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(QuantgateError, match="loop: a symlink loop; give a file path"):
        write_whole(loop, "x")
    long = tmp_path / ("n" * 250)  # a temporary named after the whole name would pass NAME_MAX (255)
    write_whole(long, "x")
    assert long.read_text() == "x"


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_a_new_file_follows_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_whole(tmp_path / "fresh.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "fresh.json").stat().st_mode & 0o7777 == mode


def test_setuid_is_not_restored(tmp_path):
    tool = tmp_path / "tool"
    tool.write_text("old")
    os.chmod(tool, 0o4755)
    write_whole(tool, "new")  # a write clears setuid; a rename must not bring it back
    assert tool.stat().st_mode & 0o7777 == 0o755


def test_a_probe_answer_whose_cache_cannot_be_written_still_stands(tmp_path, monkeypatch):
    """A timing whose cache write failed became a ServerStartError: the FP8 build FAILed over a cache."""
    from quantgate import precision

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setattr(precision, "_speed_file", lambda python, request: blocker / "speed.json")
    answer = {"ratio": 8.1, "timings": 1}
    assert precision._keep("py", "{}", answer) is answer
    assert blocker.read_text() == ""


def test_not_to_open_names_links_to_nothing_and_special_files_and_passes_the_rest(tmp_path):
    """What NonEmptyPath(read=True) and the gateway's read_token each refuse unread, in one place."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("x")
    (tmp_path / "to_fifo").symlink_to("fifo")
    (tmp_path / "gone").symlink_to("nothing")
    (tmp_path / "to_file").symlink_to("file")
    assert not_to_open(tmp_path / "fifo") == ("a named pipe (FIFO), not a regular file", "")
    assert not_to_open(tmp_path / "to_fifo") == ("a symlink to a named pipe (FIFO) at fifo, not a regular file", "")
    assert not_to_open(tmp_path / "gone") == ("a broken symlink: its target nothing does not exist", "fix the link or ")
    assert not_to_open(Path("/dev/null")) == ("a device, not a regular file", "")
    for fine in ("file", "to_file", "missing", "."):
        assert not_to_open(tmp_path / fine) is None, fine


def test_not_a_file_is_not_to_open_and_folders_and_nothing_there(tmp_path, monkeypatch):
    """What a reader that needs a file (the team keys files: limits.team_keys_file, --team-keys) refuses."""
    from quantgate.files import not_a_file

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("x")
    (tmp_path / "to_file").symlink_to("file")
    (tmp_path / "gone").symlink_to("nothing")
    (tmp_path / "folder").mkdir()
    (tmp_path / "to_folder").symlink_to("folder")
    monkeypatch.chdir(tmp_path)
    for name in ("fifo", "gone"):
        assert not_a_file(Path(name)) == not_to_open(Path(name)), name
    assert not_a_file(Path("folder")) == ("a folder, not a file", "")
    assert not_a_file(Path("to_folder")) == ("a symlink to a folder at folder, not a file", "")
    assert not_a_file(Path("none")) == (f"missing (no such file in {tmp_path})", "")
    assert not_a_file(tmp_path / "none") == ("missing (no such file)", "")
    assert not_a_file(Path("file")) is None and not_a_file(Path("to_file")) is None


def test_a_path_that_cannot_be_looked_up_is_named_not_raised(tmp_path, monkeypatch):
    """A name too long for the file system, or a folder on the way that this user cannot search: pathlib's exists()
    raised OSError out of not_to_open and not_a_file, a traceback from `canary load --team-keys`, --token-file and
    params.yaml limits.team_keys_file (as root no folder is unsearchable: stat is made to say so)."""
    import errno

    from quantgate.files import not_a_file

    long = tmp_path / ("k" * 300 + ".yaml")
    for check in (not_to_open, not_a_file):
        assert check(long) == ("a path that cannot be looked up (File name too long)", ""), check
    stat = os.stat

    def locked(path, *args, **kwargs):
        if "locked" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", locked)
    for check in (not_to_open, not_a_file):
        assert check(tmp_path / "locked/keys.yaml") == ("a path that cannot be looked up (Permission denied)", "")
