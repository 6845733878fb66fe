"""`quantgate --help` and each group's --help read whole to a new user: a group lists each command on one line
of a terminal 80 columns wide, its description never cut with "..." (click's shortening of a first docstring
sentence that does not fit; each such command says a short_help instead); and every option of every command says
what it is in its --help."""

import click
import pytest
from click.testing import CliRunner

from cli.main import cli


def _walk(command: click.Command, path: tuple[str, ...] = ()):
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _walk(sub, (*path, name))


EVERY = list(_walk(cli))
GROUPS = [path for path, command in EVERY if isinstance(command, click.Group)]


def listing(path: tuple[str, ...], columns: str) -> list[str]:
    """The lines of the Commands section of `quantgate PATH --help` in a terminal `columns` wide (click reads
    $COLUMNS, and formats at most 80 columns however wide the terminal is)."""
    result = CliRunner().invoke(cli, [*path, "--help"], env={"COLUMNS": columns})
    assert result.exit_code == 0, result.output
    section = result.output.split("\nCommands:\n", 1)[1]
    return [line for line in section.splitlines() if line.strip()]


@pytest.mark.parametrize("columns", ["80", "200"])
@pytest.mark.parametrize("path", GROUPS, ids=lambda p: " ".join(("quantgate", *p)))
def test_a_group_lists_each_command_whole_on_one_line(path, columns):
    group = dict(EVERY)[path]
    lines = listing(path, columns)
    # one line a command (a wrapped description would add a line), in the order click lists them
    assert [line.split()[0] for line in lines] == sorted(group.commands), lines
    cut = [line for line in lines if "..." in line or line.rstrip().endswith("…")]
    assert not cut, f"descriptions cut short: {cut}"
    assert all(len(line) <= 80 for line in lines), lines


@pytest.mark.parametrize("path", [p for p, _ in EVERY], ids=lambda p: " ".join(("quantgate", *p)))
def test_every_option_says_what_it_is(path):
    command = dict(EVERY)[path]
    silent = [p.opts[0] for p in command.params if isinstance(p, click.Option) and not (p.help or "").strip()]
    assert not silent, f"quantgate {' '.join(path)}: options without help text: {silent}"
