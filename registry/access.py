"""Who is acting, when the MLflow server authenticates (`mlflow server --app-name basic-auth`).

Against such a server the registry commands act as the user the server authenticated
(MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD): that name, not a self-declared `--by`,
is recorded as approver and actor. Before anything is written, the server is asked for that
user's permission on the registered model; approve, revoke, promote and rollback need EDIT or
MANAGE, and anything less is refused in one line quoting the server's answer. Without the
auth app (a plain server, or a sqlite file) `--by` is recorded as given. Set-up:
registry/README.md, "Who may approve".
"""

from __future__ import annotations

import os

from quantgate.errors import QuantgateError

USERS_GET = "/api/2.0/mlflow/users/get"  # the auth app's own routes (mlflow/server/auth/routes.py)
PERMISSION_GET = "/api/3.0/mlflow/users/permissions/get"
MAY_CHANGE = ("EDIT", "MANAGE")  # permissions on a registered model that may approve or move aliases
TIMEOUT_S = 10.0


def _credentials() -> tuple[str, str] | None:
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    return (user, os.environ.get("MLFLOW_TRACKING_PASSWORD", "")) if user else None


def authenticated_user(uri: str) -> str | None:
    """The user the server at `uri` authenticates (MLFLOW_TRACKING_USERNAME), or None when
    there is nobody to authenticate: not an http(s) URI, no username set, or a server without
    the auth app (its users route answers 404). Raises QuantgateError when it refuses them."""
    import httpx

    creds = _credentials()
    if creds is None or not uri.startswith(("http://", "https://")):
        return None
    r = _get(httpx, uri, USERS_GET, {"username": creds[0]}, creds)
    if r.status_code == 200:
        return creds[0]
    if r.status_code == 404:
        return None
    raise QuantgateError(
        f"MLflow server at {uri} refused MLFLOW_TRACKING_USERNAME={creds[0]} ({r.status_code}: "
        f"{' '.join(r.text.split())[:200]}); check MLFLOW_TRACKING_PASSWORD"
    )


def require_permission(uri: str, user: str, model: str, action: str) -> str:
    """The permission the server gives `user` on registered model `model`; QuantgateError (one
    line, nothing written) when it is not EDIT or MANAGE, which `action` needs."""
    import httpx

    params = {"username": user, "resource_type": "registered_model", "resource_id": model}
    r = _get(httpx, uri, PERMISSION_GET, params, _credentials())
    if r.status_code != 200:
        raise QuantgateError(
            f"MLflow server at {uri} would not say what {user} may do on {model} "
            f"({r.status_code}: {' '.join(r.text.split())[:200]}); nothing was changed"
        )
    permission = r.json().get("permission", "?")
    if permission not in MAY_CHANGE:
        raise QuantgateError(
            f"{user} may not {action} {model}: the MLflow server grants {user} {permission} on it and "
            f"{action} needs {' or '.join(MAY_CHANGE)} (ask an MLflow admin); nothing was changed"
        )
    return permission


def _get(httpx, uri: str, path: str, params: dict, creds):
    try:
        return httpx.get(f"{uri.rstrip('/')}{path}", params=params, auth=creds, timeout=TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise QuantgateError(f"MLflow server at {uri} is not reachable ({type(exc).__name__})") from None
