"""What the release record predicts of a canary's latency checks, said before the first step.

The profile stage measured every build's TTFT and TPOT on the serving engine (pipeline/profile.py) and the
register stage put them on its model version (tags buys.ttft_ms_p50, buys.tpot_ms_p50, buys.concurrency:
registry/tags.py). A candidate whose profiled latency is already above the policy's ratio against the stable
build will most likely abort on that check, e.g. the int8 build on an AVX2-only CPU, which decodes about 2x
slower than the 16-bit one there. The canary still runs (the profile is medians at one concurrency, possibly on
another machine, and the canary judges live p95s): this only says so at the start, so nobody waits minutes to
learn it, and records it on the canary's run (tag canary.forecast).
"""

from __future__ import annotations

from collections.abc import Mapping

from canary.policy import CanaryPolicy

# latency check -> (the profile's figure on the version's tags, what it is)
PROFILED = {"ttft_p95_ratio": ("buys.ttft_ms_p50", "TTFT"), "tpot_p95_ratio": ("buys.tpot_ms_p50", "TPOT")}


def _figure(tags: Mapping[str, str], key: str) -> float | None:
    if tags.get("buys.status") != "profiled":
        return None
    try:
        value = float(tags[key])
    except (KeyError, ValueError):
        return None
    return value if value > 0 else None


def latency_forecast(
    policy: CanaryPolicy, stable: tuple[str, Mapping[str, str]], candidate: tuple[str, Mapping[str, str]]
) -> list[str]:
    """One line per latency check of `policy` that the profiled ratio candidate / stable already exceeds.

    `stable` and `candidate` are (version, that model version's tags). Ratios are of the profile's p50s
    (ms) at its largest concurrency, compared with the check's `max` (a ratio of live p95s). Empty when
    the policy has no latency check, either version is unprofiled or predates these tags, or the two were
    profiled at different concurrencies (not comparable). Pure; raises nothing.
    """
    (sv, st), (cv, ct) = stable, candidate
    if st.get("buys.concurrency") != ct.get("buys.concurrency"):
        return []
    lines = []
    for check in policy.checks:
        if check.name not in PROFILED:
            continue
        key, what = PROFILED[check.name]
        s, c = _figure(st, key), _figure(ct, key)
        if s is None or c is None or c / s <= check.bound:
            continue
        lines.append(
            f"v{cv}'s profile has {what} p50 {c:.0f} ms against {s:.0f} ms for v{sv} (at {ct['buys.concurrency']} "
            f"in flight, where `dvc repro` profiled them): {c / s:.2f}x, above {check.name} max {check.bound:g}; "
            f"on that kind of machine expect this canary to abort on {check.name}"
        )
    return lines
