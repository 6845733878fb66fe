"""The gate's quality table, shared by the gate report (pipeline/gate.py), the model version's description
(pipeline/register.py) and `quantgate report`."""

from __future__ import annotations

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
