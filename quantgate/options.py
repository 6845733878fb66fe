"""The option types the `quantgate` commands share (cli/main.py, canary/commands.py): a finite positive number
(RATE, SECONDS), a non-empty path (PATH; IN_FILE for a file a command reads; Folder, EVALS), an option naming one
(path_option), and options that travel as one typed object (grouped). Click's usage errors (exit 2, naming the
option or argument) for bad values."""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import click
from click.core import ParameterSource

from quantgate.files import dangling, not_to_open

DEFAULT = ParameterSource.DEFAULT


class Positive(click.FloatRange):
    """A finite number above 0, at most `max` (click's FloatRange lets nan and inf through)."""

    def __init__(self, max: float):
        super().__init__(min=0, min_open=True, max=max)

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


RATE = Positive(1000)  # requests/s: one load process on loopback offers far less than this
SECONDS = Positive(7 * 24 * 3600)


class NonEmptyPath(click.Path):
    """A file or folder argument or option, as a Path; an empty one ('', e.g. an unset shell variable) is refused
    naming it: Path("") is ".", so it would silently mean the working directory. With `read` (a file the command
    reads), one that exists and is neither a regular file nor a folder (a FIFO, socket or device) is refused
    too, never opened: reading a FIFO nobody writes waits forever; so is a symlink to nothing, named as broken or a
    loop (quantgate.files.not_to_open, as the gateway's read_token refuses its --token-file). A folder or a
    missing file is left to the command, which names what it wanted. With `empty_as_none` (a file the command
    reads only in some runs, and checks only then: --token-file, unread while $QUANTGATE_ADMIN_TOKEN is set) an
    empty one is None, for the command to refuse as a usage error only where it would read it."""

    def __init__(self, read: bool = False, empty_as_none: bool = False) -> None:
        super().__init__(path_type=Path)
        self.read, self.empty_as_none = read, empty_as_none

    def convert(self, value, param, ctx):
        if value == "" and self.empty_as_none:
            return None
        if value == "":  # a usage error (exit 2, naming the option or argument), as every bad argument is
            self.fail(f"the path is empty; give a {'file' if self.read else 'file or folder'}", param, ctx)
        path = super().convert(value, param, ctx)
        if self.read and (bad := not_to_open(path)) is not None:  # DVC's outs may be links into its cache
            self.fail(f"{path} is {bad[0]}; {bad[1]}give the file itself", param, ctx)
        return path


class Folder(NonEmptyPath):
    """A folder the command reads (a non-empty path, NonEmptyPath); one that is missing or not a folder is a usage
    error naming it, and saying `advice` (which folder to give); so is a symlink to nothing (broken or a loop, as
    quantgate.files.dangling says) and a path that cannot be looked up (a name too long); one missing as the default
    says so: the command runs outside the project folder."""

    def __init__(self, advice: str) -> None:
        super().__init__()
        self.advice = advice

    def convert(self, value, param, ctx):
        path = super().convert(value, param, ctx)
        try:
            folder, there, link = path.is_dir(), path.exists(), path.is_symlink()
        except OSError as exc:  # ENAMETOOLONG, EACCES: pathlib raises them (a traceback), as not_to_open says
            self.fail(f"{path} cannot be looked up ({exc.strerror or type(exc).__name__}); {self.advice}", param, ctx)
        if not folder:
            fix = ""
            if link and not there:  # there is a link, to nothing: broken or a loop, as NonEmptyPath(read) says
                state, fix = f"is {dangling(path)}", "fix the link or "
            else:
                state = "is not a folder" if there else "does not exist"
            if ctx is not None and param is not None and ctx.get_parameter_source(param.name) is DEFAULT:
                given = param.opts[0] if isinstance(param, click.Option) else param.human_readable_name
                state += f" (the default: run this in the project folder, or give {given})"
            self.fail(f"{path} {state}; {fix}{self.advice}", param, ctx)
        return path


PATH = NonEmptyPath()
# the folders of team eval sets: --evals of canary load and canary run; evals new --root; evals validate PATH
EVALS = Folder("give the folder of team eval sets (evals/); see evals/README.md")
TEAMS_ROOT = Folder("give the folder that holds the team folders (evals/)")
TEAM_FOLDERS = Folder("give the folder of team eval sets (evals/) or a team's folder; see evals/README.md")
IN_FILE = NonEmptyPath(read=True)  # a file the command always reads (--gate-json; not --token-file: read_token)
SOMETIMES_READ = NonEmptyPath(empty_as_none=True)  # --token-file: '' is None, refused only where it is read


def path_option(flag: str, default: str, help_text: str, read: bool = False):
    """An option naming a file or folder, with its default shown; `read`: a file the command reads (IN_FILE)."""
    return click.option(flag, type=IN_FILE if read else PATH, default=Path(default), show_default=True, help=help_text)


def grouped(name: str, cls: type, *options):
    """Declare `options` (click.option decorators, in --help order) on a command and hand the command their
    values as one `cls` (a dataclass), its parameter `name`: related options travel as one typed object and a
    command keeps few parameters. Each option's parameter name is a field of `cls`; a field without an option
    keeps its default."""

    def decorate(command):
        fields = {f.name for f in dataclasses.fields(cls)}

        @functools.wraps(command)
        def with_group(*args, **values):
            group = cls(**{field: values.pop(field) for field in fields & values.keys()})
            return command(*args, **values, **{name: group})

        for option in reversed(options):  # decorators apply bottom-up: the last option first
            with_group = option(with_group)
        return with_group

    return decorate
