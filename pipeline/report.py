"""The gate's quality table, shared by the gate report (pipeline/gate.py), the model version's description
(pipeline/register.py) and `quantgate report`."""

from __future__ import annotations

from quantgate.errors import QuantgateError
from quantgate.results import GateResult


def fmt(x, spec: str = ".3f") -> str:
    """`x` formatted with `spec`, or "-" for None (a cell with no figure)."""
    return "-" if x is None else format(x, spec)


def table(result: GateResult, builds: list[str] | None = None) -> str:
    """The gate result as a markdown table (one row per build and team; `builds`: only these, in this order).
    One sign convention: `drop` and its CI are how much worse the build is (positive = worse), as the margin
    bounds it."""
    lines = [
        "| build | team | metric | n | fp16 | candidate | drop (+ = worse) | drop CI | margin | recovery % | p (NI) "
        "| verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for build in builds or list(result.builds):
        for team, c in result.builds[build].teams.items():
            ci = f"[{c.lower:+.3f}, {c.upper:+.3f}]" if c.compared else "-"
            lines.append(
                f"| {build} | {team} | {c.metric} | {fmt(c.n, 'd')} | {fmt(c.baseline)} | "
                f"{fmt(c.candidate)} | {fmt(c.drop, '+.3f')} | {ci} | {fmt(c.margin)} | "
                f"{fmt(c.recovery_pct, '.1f')} | {fmt(c.p_value, '.3g')} | {c.verdict} |"
            )
    return "\n".join(lines)


def check_consistent(result: GateResult, path) -> None:
    """Raise QuantgateError naming the build and team when a build's verdict is milder than one of its teams'
    (PASS with a team FAIL): the gate gives a build its worst team's verdict, or FAIL (pipeline/gate.py), so
    such a file was not written by the gate as it stands."""
    from quantgate.judging import SEVERITY
    from quantgate.stats import Verdict

    for build, b in result.builds.items():
        for team, c in b.teams.items():
            if SEVERITY.index(Verdict(c.verdict)) > SEVERITY.index(Verdict(b.verdict)):
                raise QuantgateError(
                    f"{path}: build {build} is {b.verdict} but its team {team} is {c.verdict}; the gate gives a "
                    f"build its worst team's verdict, so this file is not the gate's: re-run `dvc repro gate`"
                )
