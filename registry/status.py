"""A registered model at a glance: versions, builds, gate verdicts, approvals, aliases, and the builds
the last register stage left unregistered (registry/runs.py)."""

from __future__ import annotations

from quantgate.errors import QuantgateError
from registry import aliases, audit, lock, runs, tags, versions
from registry.approval import read_approval, read_recommendation, verdict_problem


def _approval_cell(mv, recorded: str | None) -> tuple[str, str | None]:
    """(short cell, explanation line or None) for a version's approval."""
    a = read_approval(mv.tags, recorded)
    if a.approved:
        return (f"approved:{a.by}" + ("(override)" if a.override else "")), None
    if a.state == "revoked":
        return f"revoked:{a.by or '?'}", None
    if a.state == "none":
        return "unapproved", None
    return "NOT-APPROVED", a.why


def _deleted_warnings(mlflow_client, model_name: str, existing: set[str]) -> list[str]:
    """A warning per alias whose audited version no longer exists (deleted outside quantgate:
    MLflow drops the alias with the version, so nothing says it served)."""
    lines = []
    for alias, v in aliases.aliases_at(mlflow_client, model_name, audit.utc_now()).items():
        if v is not None and v not in existing:
            fix = f"; promote a build: quantgate promote {model_name} VERSION" if alias == aliases.PRODUCTION else ""
            lines.append(
                f"  warning: the audit trail says {alias}=v{v}, but v{v} no longer exists "
                f"(deleted outside quantgate){fix}"
            )
    return lines


def buys_cell(t: dict[str, str]) -> str:
    """The what-it-buys column: "$<per 1M tokens> (<x> fp16) reco=<yes|no|override|baseline>", or
    "unprofiled reco=no" / "-" when the version or run has no such tags (registry/tags.py buys.*)."""
    reco, _ = read_recommendation(t)
    if t.get("buys.status") == "profiled" and "buys.usd_per_mtok" in t:
        x = t.get("buys.usd_per_mtok_x")
        price = f"${float(t['buys.usd_per_mtok']):.3f}" + (f" ({float(x):.2f}x)" if x else "")
        return f"{price} reco={reco}"
    if t.get("buys.status") == "unprofiled":
        return f"unprofiled reco={reco}"
    return "-" if reco == "-" else f"reco={reco}"


def same_weights_cell(t: dict[str, str]) -> str:
    """ " same-weights-as=<build>" for a build whose weights are another build's of its run (registry/tags.py
    same_weights_as), else ""."""
    return f" same-weights-as={t[tags.SAME_WEIGHTS]}" if t.get(tags.SAME_WEIGHTS) else ""


def inexact_cell(t: dict[str, str]) -> str:
    """ " inexact-int8-kernel" for a build scored through an int8 kernel the platform probe found inexact
    (registry/tags.py gate.inexact_kernel), else ""."""
    return " inexact-int8-kernel" if t.get(tags.INEXACT_KERNEL) else ""


def status_lines(mlflow_client, model_name: str) -> list[str]:
    """Lines describing every version of `model_name`, newest first, a held lock if any, then the
    builds of the last register stage that are runs only, with their verdicts and run ids.

    Raises QuantgateError if the model is not registered (or is one of quantgate's locks).
    """

    if lock.is_lock(model_name):
        raise QuantgateError(f"{model_name!r} is quantgate's registry lock, not a model")
    rm = versions.registered_model(mlflow_client, model_name)  # any other answer propagates as the server gave it
    by_version: dict[str, list[str]] = {}
    for alias, version in (rm.aliases or {}).items():
        by_version.setdefault(str(version), []).append(alias)
    lines = [
        f"{model_name}: aliases " + (", ".join(f"{a}=v{v}" for a, v in sorted((rm.aliases or {}).items())) or "none")
    ]
    held = lock.holder_of(mlflow_client, model_name)
    if held is not None:
        lines.append(
            f"  lock: held by {held.get('lock.holder', '?')} (pid {held.get('lock.pid', '?')} on "
            f"{held.get('lock.host', '?')}) for {held['age_s']:.0f} s"
        )
    found = sorted(mlflow_client.search_model_versions(f"name='{model_name}'"), key=lambda m: -int(m.version))
    lines += _deleted_warnings(mlflow_client, model_name, {str(mv.version) for mv in found})
    left = runs.unregistered(mlflow_client, model_name)
    names = [mv.tags.get(tags.BUILD, "?") for mv in found] + [r.data.tags.get(tags.BUILD, "?") for r in left]
    w = max([6, *map(len, names)])  # one build column for versions and runs (int4-mixed is 10 wide)
    for mv in found:
        t = mv.tags
        per_team = " ".join(f"{team}={verdict}" for team, verdict in tags.team_verdicts(t).items())
        held_by = ",".join(sorted(by_version.get(str(mv.version), [])))
        recorded = versions.recorded_verdict(mlflow_client, mv)
        cell, why = _approval_cell(mv, recorded)
        why = why or verdict_problem(t.get(tags.VERDICT), recorded)  # also on rows nobody approved
        lines.append(
            f"  v{mv.version:<3} {t.get(tags.BUILD, '?'):<{w}} {t.get('scheme', '?'):<12} "
            f"gate={t.get(tags.VERDICT, '?'):<12} {buys_cell(t):<29}"
            f" {cell:<24} {per_team}{same_weights_cell(t)}{inexact_cell(t)}"
            f" {('[' + held_by + ']') if held_by else ''}".rstrip()
        )
        if why:
            lines.append(f"        {why}")
        if override := t.get(tags.REGISTERED_OVERRIDE):
            lines.append(f"        registered by {t.get(tags.REGISTERED_BY, '?')} overriding the gate: {override}")
    if left:
        lines.append(
            "  not registered (gate did not PASS; to ship one anyway: quantgate register RUN_ID --override REASON):"
        )
    for run in left:
        t = run.data.tags
        per_team = " ".join(f"{team}={verdict}" for team, verdict in tags.team_verdicts(t).items())
        lines.append(
            f"  -    {t.get(tags.BUILD, '?'):<{w}} {t.get(tags.SCHEME, '?'):<12} "
            f"gate={run.data.params.get(tags.VERDICT, '?'):<12} {buys_cell(t):<29} run {run.info.run_id:<32} "
            f"{per_team}{same_weights_cell(t)}{inexact_cell(t)}".rstrip()
        )
    return lines
