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
from collections.abc import Callable
from dataclasses import dataclass, field

from quantgate.errors import QuantgateError

API_VERSION = "gateway.networking.k8s.io/v1"
SERVICE_TEMPLATE = "{model}-v{version}"
PATH_PREFIX = "/v1"
LABEL = "quantgate"  # prefix of the labels and annotations written on each route
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # RFC 1123 label
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")  # and at most 253
MAX_LABEL = 63  # characters of an RFC 1035 label, a Kubernetes Service's name
_DECIMALS = 2  # a step percent may have this many decimals (weights out of 100 * 10**_DECIMALS)


def dns_label(text: str, what: str) -> str:
    """`text` as an RFC 1035 DNS label (a Kubernetes Service name): lowercase, runs of other
    characters -> `-`, trimmed. Raises QuantgateError (naming `what`) when the result is empty,
    starts with a digit or is over 63 characters."""
    label = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if not label or not label[0].isalpha() or len(label) > MAX_LABEL:
        fix = "another --service template" if what == "service name" else "a shorter name"
        raise QuantgateError(
            f"{what} {text!r} gives {label!r}, not a DNS label (a letter first, [a-z0-9-], at most 63 "
            f"characters); use {fix}"
        )
    return label


def label_problem(name: str) -> str | None:
    """Why `name` is not an RFC 1123 DNS label (`'Prod' is not a DNS label (...)`), or None when it is one."""
    if _DNS_LABEL.fullmatch(name):
        return None
    return (
        f"{name!r} is not a DNS label (lowercase [a-z0-9-], a letter or digit first and last, at most 63 characters); "
        "give the name as the cluster has it"
    )


def subdomain_problem(name: str) -> str | None:
    """Why `name` is not an RFC 1123 DNS subdomain, what Kubernetes names most objects with (a Gateway's
    metadata.name: labels joined by dots, at most 253 characters; Kubernetes' IsDNS1123Subdomain), or None."""
    if len(name) <= 253 and _DNS_SUBDOMAIN.fullmatch(name):
        return None
    return (
        f"{name!r} is not a DNS subdomain (lowercase [a-z0-9-] labels joined by dots, each a letter or digit first "
        "and last, at most 253 characters); give the name as the cluster has it"
    )


def require_dns_name(name: str, what: str, problem: Callable[[str], str | None] = label_problem) -> str:
    """`name` unchanged if it already is an RFC 1123 DNS label (a namespace), or what `problem` accepts
    (subdomain_problem: a Gateway name); QuantgateError otherwise: these name existing objects, so they are
    checked, not rewritten."""
    if (why := problem(name)) is not None:
        raise QuantgateError(f"{what} {why}")
    return name


def template_problem(template: str) -> str | None:
    """Why `template` cannot name the Services (`'{nope}': use only {model} and {version}, ...`: a placeholder
    other than those, none for the version, unbalanced braces, a placeholder inside a format spec, or a format spec
    a name cannot take), or None when it can: then `template.format(model=..., version=...)` cannot fail."""
    import string

    try:
        parsed = [(f, spec) for _, f, spec, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:  # unbalanced braces: "{model", "{version}}"
        return f"{template!r}: {exc}; e.g. {SERVICE_TEMPLATE}"
    fields = [f for f, _ in parsed]
    if any("{" in spec for _, spec in parsed):  # "{version:{nope}}": parse does not list the field in a spec
        return (
            f"{template!r}: a placeholder inside a format spec; use only {{model}} and {{version}}, "
            f"e.g. {SERVICE_TEMPLATE}"
        )
    if "version" not in fields or any(f not in ("model", "version") for f in fields):
        return (
            f"{template!r}: use only {{model}} and {{version}}, and {{version}} at least "
            f"(stable and candidate need different Services), e.g. {SERVICE_TEMPLATE}"
        )
    for _, spec in parsed:  # "{version:1000000000}" would make a string of that size before dns_label refused it
        width = re.match(r"(?:.?[<>=^])?[+\- ]?z?#?0?(\d*)", spec, re.DOTALL).group(1)
        if width and (len(width) > 2 or int(width) > MAX_LABEL):  # int() refuses 4,300 digits and more
            return f"{template!r}: a width of {width} characters; a Service name has at most {MAX_LABEL}"
    try:  # a format spec no name takes ("{version:d}"): it fails alike for every model and version (str's specs)
        template.format(model="m", version="1")
    except ValueError as exc:
        return f"{template!r}: {exc}; use only {{model}} and {{version}}, e.g. {SERVICE_TEMPLATE}"
    return None


def service_name(model: str, version: str, template: str = SERVICE_TEMPLATE) -> str:
    """The Service serving `version` of `model`: `template` with {model} and {version} filled in,
    as a DNS label (see `dns_label`). Raises QuantgateError for other placeholders (template_problem)."""
    if (problem := template_problem(template)) is not None:
        raise QuantgateError(f"service template {problem}")
    return dns_label(template.format(model=model, version=version), "service name")


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


@dataclass
class RouteSplit:
    """The canary's traffic split (canary/traffic.py) as Kubernetes Gateway API HTTPRoutes: each
    `set_weight(p)` writes the route for p % (through `write`, e.g. to a file `kubectl apply` reads;
    kept in `routes` too), `drain()` the rollback route (candidate weight 0). It sees no requests
    (`samples_since`, `shadows_since` are empty): on a cluster its own metrics judge the steps.

    All routes are named after the model (`dns_label(model)`), live in `namespace`, attach to
    Gateway `gateway` in that namespace, and send path prefix /v1 to the stable and candidate
    Services (`service_name(model, version, service)`) on `port`. Labels and annotations under
    `quantgate/` name the model, both versions, the step (1-based, or "rollback") and its percent.
    Raises QuantgateError for a name that cannot be a DNS label (a DNS subdomain for the Gateway), a port
    outside 1..65535, a
    percent with more than two decimals or that is not one of `steps`, or stable == candidate.
    """

    model: str
    stable_version: str
    candidate_version: str
    steps: list[float]
    gateway: str
    namespace: str
    port: int
    service: str = SERVICE_TEMPLATE
    write: Callable[[dict], None] = lambda doc: None
    routes: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.stable_version == self.candidate_version:
            raise QuantgateError(
                f"{self.model} v{self.candidate_version} is already the stable build; nothing to roll out"
            )
        if not 1 <= self.port <= 65535:
            raise QuantgateError(f"port {self.port}: give a Service port in 1..65535")
        self.name = dns_label(self.model, "model name")
        require_dns_name(self.namespace, "namespace")
        require_dns_name(self.gateway, "gateway", subdomain_problem)
        self.services = tuple(
            service_name(self.model, v, self.service) for v in (self.stable_version, self.candidate_version)
        )

    def set_weight(self, percent: float) -> None:
        """Write the route sending `percent` of traffic to the candidate (0: the rollback route)."""
        if percent == 0:
            step = "rollback"
        elif percent in self.steps:
            step = str(self.steps.index(percent) + 1)
        else:
            raise QuantgateError(
                f"{percent:g}% is not a step of the policy ({self.steps}); routes are written per step"
            )
        doc = self._route(step, percent)
        self.routes.append(doc)
        self.write(doc)

    def samples_since(self, t: float) -> list:
        """Nothing: the requests go through the cluster's gateway, not here."""
        return []

    def shadows_since(self, t: float) -> list:
        """Nothing: no shadowing on a cluster route."""
        return []

    def drain(self) -> None:
        """Write the rollback route (candidate weight 0)."""
        self.set_weight(0)

    def _route(self, step: str, percent: float) -> dict:
        labels = {
            "app.kubernetes.io/name": self.name,
            "app.kubernetes.io/managed-by": LABEL,
            f"{LABEL}/stable-version": self.stable_version,
            f"{LABEL}/candidate-version": self.candidate_version,
            f"{LABEL}/step": step,
        }
        annotations = {
            f"{LABEL}/model": self.model,
            f"{LABEL}/step": step if step == "rollback" else f"{step}/{len(self.steps)}",
            f"{LABEL}/candidate-percent": f"{percent:g}",
        }
        refs = [
            {"kind": "Service", "name": name, "port": self.port, "weight": weight}
            for name, weight in zip(self.services, weights(percent), strict=True)
        ]
        match = {"path": {"type": "PathPrefix", "value": PATH_PREFIX}}
        return {
            "apiVersion": API_VERSION,
            "kind": "HTTPRoute",
            "metadata": {"name": self.name, "namespace": self.namespace, "labels": labels, "annotations": annotations},
            "spec": {
                "parentRefs": [{"name": self.gateway, "namespace": self.namespace}],
                "rules": [{"matches": [match], "backendRefs": refs}],
            },
        }


def http_routes(
    model: str,
    stable_version: str,
    candidate_version: str,
    steps: list[float],
    **where,
) -> list[dict]:
    """One HTTPRoute per step of `steps` (percents of traffic to the candidate), then a rollback
    route (candidate weight 0); each a dict ready for yaml.safe_dump: what a RouteSplit writes
    through a whole canary. `where`: RouteSplit's gateway, namespace, port and service (template).
    Raises QuantgateError as RouteSplit does.
    """
    split = RouteSplit(model, stable_version, candidate_version, list(steps), **where)
    for percent in steps:
        split.set_weight(percent)
    split.drain()
    return split.routes
