"""The gate's recovery plot: recovery % per team per build, with confidence intervals.

Recovery = candidate score / 16-bit score x 100 (inverted for lower-is-better metrics); its
interval maps the drop's confidence bounds through the same formula. The dashed mark per team
is the recovery at the team's margin: a build PASSes when its whole interval lies right of it.
"""

from __future__ import annotations

from pathlib import Path

from quantgate.results import GateResult, TeamComparison


def recovery_interval(c: TeamComparison) -> tuple[float, float] | None:
    """(low, high) recovery % from a comparison's baseline score and drop bounds; None if not computable."""
    base, lower, upper = c.baseline, c.lower, c.upper
    if base is None or lower is None or not base:
        return None
    if c.higher_is_better:
        return 100.0 * (base - upper) / base, 100.0 * (base - lower) / base
    hi_cand, lo_cand = base + upper, base + lower
    if hi_cand <= 0 or lo_cand <= 0:
        return None
    return 100.0 * base / hi_cand, 100.0 * base / lo_cand


def recovery_plot(result: GateResult, path: Path) -> None:
    """Write the PNG for a gate result (pipeline/gate.py `gate()` output) to `path`.

    Rows that could not be compared (evaluation errors) are drawn as a red cross at 0 with
    the verdict, so a failed build is visible rather than missing.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    builds = list(result.builds)
    teams = sorted({t for b in result.builds.values() for t in b.teams})
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.9 * len(teams)), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    step = 0.8 / max(len(builds), 1)
    for bi, build in enumerate(builds):
        for ti, team in enumerate(teams):
            c = result.builds[build].teams.get(team)
            y = ti - 0.4 + step * (bi + 0.5)
            ci = recovery_interval(c) if c else None
            if c is None or c.recovery_pct is None or ci is None:
                ax.plot([0], [y], "x", color="tab:red")
                ax.annotate(
                    f"{build}: {c.verdict if c else '?'} (no scores)",
                    (0, y),
                    xytext=(6, -3),
                    textcoords="offset points",
                    fontsize=8,
                    color="tab:red",
                )
                continue
            rec = c.recovery_pct
            ax.errorbar(
                [rec],
                [y],
                xerr=[[rec - ci[0]], [ci[1] - rec]],
                fmt="o",
                capsize=3,
                color=colors[bi % len(colors)],
                label=build if ti == 0 else None,
            )
            ax.annotate(c.verdict, (ci[1], y), xytext=(4, -3), textcoords="offset points", fontsize=8)
            base, margin = c.baseline, c.margin
            if base:
                edge = 100.0 * (base - margin) / base if c.higher_is_better else 100.0 * base / (base + margin)
                ax.plot([edge, edge], [ti - 0.45, ti + 0.45], "--", color="grey", linewidth=1)
    ax.axvline(100.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(teams)), teams)
    ax.set_xlabel("recovery vs 16-bit build (%), one-sided confidence bounds; dashed = team margin")
    ax.set_title("quantgate: recovery per team and build")
    if builds:
        ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def cost_plot(points: list[dict], unprofiled: dict[str, str], path: Path) -> None:
    """Write the quality-vs-cost PNG to `path`: per profiled build (pipeline/buys.py `cost_points`), its
    worst-team recovery % (y; the baseline at 100) against its $ per 1M output tokens (x), labelled with its
    verdict; recommended builds as stars. `unprofiled` ({build: reason}) is listed under the axes, so a build
    without a cost is visible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5 + 0.25 * len(unprofiled)), dpi=110)
    for p in points:
        y = p["worst_recovery_pct"] if p["worst_recovery_pct"] is not None else 0.0
        ax.plot([p["usd_per_mtok"]], [y], "*" if p["recommended"] else "o", markersize=12 if p["recommended"] else 7)
        label = f"{p['build']} ({p['verdict']})"
        ax.annotate(label, (p["usd_per_mtok"], y), xytext=(6, 4), textcoords="offset points", fontsize=9)
    ax.axhline(100.0, color="black", linewidth=0.8)
    ax.margins(x=0.25, y=0.1)  # room for the labels right of the points
    ax.set_xlabel("$ per 1M output tokens (cost params, measured throughput)")
    ax.set_ylabel("worst team's recovery vs 16-bit (%)")
    ax.set_title("quantgate: quality vs cost per build (star = recommended)")
    if unprofiled:
        note = "\n".join(f"unprofiled: {b}: {why[:110]}" for b, why in sorted(unprofiled.items()))
        fig.text(0.01, 0.01, note, fontsize=7, color="tab:red", va="bottom")
        fig.subplots_adjust(bottom=0.15 + 0.05 * len(unprofiled))
    else:
        fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
