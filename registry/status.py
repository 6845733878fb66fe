"""A registered model at a glance: versions, builds, gate verdicts, approvals, aliases."""
from __future__ import annotations

from pipeline.errors import QuantgateError


def status_lines(mlflow_client, model_name: str) -> list[str]:
    """Lines describing every version of `model_name`, newest first.

    Raises QuantgateError if the model is not registered.
    """
    from mlflow.exceptions import MlflowException

    try:
        rm = mlflow_client.get_registered_model(model_name)
    except MlflowException:
        raise QuantgateError(f"model {model_name!r} is not registered at this tracking URI; run `dvc repro`") from None
    by_version: dict[str, list[str]] = {}
    for alias, version in (rm.aliases or {}).items():
        by_version.setdefault(str(version), []).append(alias)
    lines = [f"{model_name}: aliases " + (", ".join(f"{a}=v{v}" for a, v in sorted((rm.aliases or {}).items())) or "none")]
    versions = sorted(mlflow_client.search_model_versions(f"name='{model_name}'"), key=lambda m: -int(m.version))
    for mv in versions:
        t = mv.tags
        teams = sorted({k.split(".")[1] for k in t if k.startswith("gate.") and k.endswith(".verdict") and k.count(".") == 2})
        per_team = " ".join(f"{team}={t[f'gate.{team}.verdict']}" for team in teams)
        aliases = ",".join(sorted(by_version.get(str(mv.version), [])))
        lines.append(f"  v{mv.version:<3} {t.get('build', '?'):<6} {t.get('scheme', '?'):<12} gate={t.get('gate.verdict', '?'):<9}"
                     f" {per_team} {('[' + aliases + ']') if aliases else ''}".rstrip())
    return lines
