"""The canary's steps as Kubernetes Gateway API HTTPRoutes, for an engine that runs the rollout.

`quantgate canary render MODEL VERSION --format gateway-api` (canary/commands.py) calls
`http_routes()`: one HTTPRoute (gateway.networking.k8s.io/v1) per policy step plus a final
rollback route, all with the same name, so applying them one after another moves the weights
of a single route. Each route has one rule, path prefix `/v1` (the OpenAI API vLLM serves),
with two backendRefs: the stable Service (weight 100 - p) and the candidate Service (weight p).

Weights are integer proportions (Gateway API), not percents: out of 100 for a whole percent;
a fractional percent with up to two decimals is written out of 10000 (0.5 % -> 9950 / 50);
more decimals are refused. Services are named by a template, default `{model}-v{version}`,
turned into an RFC 1035 label (what Kubernetes requires of a Service name): lowercase, every
run of characters outside [a-z0-9] -> `-`, trimmed of `-`; a name that is then empty, starts
with a digit or is over 63 characters is refused (truncating could make two names one).

Pure: no registry, no I/O; errors are QuantgateError naming the value and the fix.
"""

from __future__ import annotations

import re

from quantgate.errors import QuantgateError

API_VERSION = "gateway.networking.k8s.io/v1"
SERVICE_TEMPLATE = "{model}-v{version}"
PATH_PREFIX = "/v1"
LABEL = "quantgate"  # prefix of the labels and annotations written on each route
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # RFC 1123 label
_DECIMALS = 2  # a step percent may have this many decimals (weights out of 100 * 10**_DECIMALS)


def dns_label(text: str, what: str) -> str:
    """`text` as an RFC 1035 DNS label (a Kubernetes Service name): lowercase, runs of other
    characters -> `-`, trimmed. Raises QuantgateError (naming `what`) when the result is empty,
    starts with a digit or is over 63 characters."""
    label = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if not label or not label[0].isalpha() or len(label) > 63:
        fix = "another --service template" if what == "service name" else "a shorter name"
        raise QuantgateError(
            f"{what} {text!r} gives {label!r}, not a DNS label (a letter first, [a-z0-9-], at most 63 "
            f"characters); use {fix}"
        )
    return label


def require_dns_label(name: str, what: str) -> str:
    """`name` unchanged if it already is an RFC 1123 DNS label (a namespace, a Gateway name);
    QuantgateError otherwise: these name existing objects, so they are checked, not rewritten."""
    if not _DNS_LABEL.fullmatch(name):
        raise QuantgateError(f"{what} {name!r} is not a DNS label (lowercase [a-z0-9-], at most 63 characters)")
    return name


def service_name(model: str, version: str, template: str = SERVICE_TEMPLATE) -> str:
    """The Service serving `version` of `model`: `template` with {model} and {version} filled in,
    as a DNS label (see `dns_label`). Raises QuantgateError for other placeholders."""
    import string

    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:  # unbalanced braces: "{model", "{version}}"
        raise QuantgateError(f"service template {template!r}: {exc}; e.g. {SERVICE_TEMPLATE}") from None
    if "version" not in fields or any(f not in ("model", "version") for f in fields):
        raise QuantgateError(
            f"service template {template!r}: use only {{model}} and {{version}}, and {{version}} at least "
            f"(stable and candidate need different Services), e.g. {SERVICE_TEMPLATE}"
        )
    try:
        text = template.format(model=model, version=version)
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise QuantgateError(
            f"service template {template!r}: {exc}; use only {{model}} and {{version}}, e.g. {SERVICE_TEMPLATE}"
        ) from None
    return dns_label(text, "service name")


def weights(percent: float) -> tuple[int, int]:
    """(stable, candidate) integer weights for `percent` (0..100) of traffic to the candidate:
    out of 100 for a whole percent, out of 10000 for one with up to two decimals.
    Raises QuantgateError for more decimals or a percent outside [0, 100]."""
    if not 0 <= percent <= 100:
        raise QuantgateError(f"step {percent:g}%: a step is a percent of traffic in [0, 100]")
    for scale in (1, 10**_DECIMALS):
        scaled = percent * scale
        if abs(scaled - round(scaled)) < 1e-9:
            return 100 * scale - round(scaled), round(scaled)
    raise QuantgateError(
        f"step {percent:g}%: Gateway API weights are integers; give canary.steps in params.yaml "
        f"with at most {_DECIMALS} decimals"
    )


def http_routes(
    model: str,
    stable_version: str,
    candidate_version: str,
    steps: list[float],
    *,
    gateway: str,
    namespace: str,
    port: int,
    service: str = SERVICE_TEMPLATE,
) -> list[dict]:
    """One HTTPRoute per step of `steps` (percents of traffic to the candidate), then a rollback
    route (candidate weight 0); each a dict ready for yaml.safe_dump.

    All routes are named after the model (`dns_label(model)`), live in `namespace`, attach to
    Gateway `gateway` in that namespace, and send path prefix /v1 to the stable and candidate
    Services (`service_name(model, version, service)`) on `port`. Labels and annotations under
    `quantgate/` name the model, both versions, the step (1-based, or "rollback") and its percent.
    Raises QuantgateError for a name that cannot be a DNS label, a port outside 1..65535, a
    step percent with more than two decimals, or stable == candidate (nothing to roll out).
    """
    if stable_version == candidate_version:
        raise QuantgateError(f"{model} v{candidate_version} is already the stable build; nothing to roll out")
    if not 1 <= port <= 65535:
        raise QuantgateError(f"port {port}: give a Service port in 1..65535")
    route = dns_label(model, "model name")
    require_dns_label(namespace, "namespace")
    require_dns_label(gateway, "gateway")
    stable = service_name(model, stable_version, service)
    candidate = service_name(model, candidate_version, service)
    plan = [(str(i), p) for i, p in enumerate(steps, 1)] + [("rollback", 0)]
    return [
        {
            "apiVersion": API_VERSION,
            "kind": "HTTPRoute",
            "metadata": {
                "name": route,
                "namespace": namespace,
                "labels": {
                    "app.kubernetes.io/name": route,
                    "app.kubernetes.io/managed-by": LABEL,
                    f"{LABEL}/stable-version": stable_version,
                    f"{LABEL}/candidate-version": candidate_version,
                    f"{LABEL}/step": step,
                },
                "annotations": {
                    f"{LABEL}/model": model,
                    f"{LABEL}/step": step if step == "rollback" else f"{step}/{len(steps)}",
                    f"{LABEL}/candidate-percent": f"{percent:g}",
                },
            },
            "spec": {
                "parentRefs": [{"name": gateway, "namespace": namespace}],
                "rules": [
                    {
                        "matches": [{"path": {"type": "PathPrefix", "value": PATH_PREFIX}}],
                        "backendRefs": [
                            {"kind": "Service", "name": name, "port": port, "weight": weight}
                            for name, weight in zip((stable, candidate), weights(percent), strict=True)
                        ],
                    }
                ],
            },
        }
        for step, percent in plan
    ]
