"""`quantgate canary render --format gateway-api`: the HTTPRoutes parsed back from the YAML
(structure, exact weights per step, DNS-label names), and the command against a real sqlite
registry made by pipeline.register from tiny safetensors builds (stable = production, else
fallback; refusals are one line, exit 1)."""

import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from canary.render import http_routes, service_name, weights
from cli.main import cli
from pipeline.register import RegisterParams, register
from quantgate.errors import QuantgateError
from registry import aliases, approval, store
from tests.conftest import safetensors_build
from tests.test_register import gate_result, team_summary

MODEL = "smollm2-135m-instruct"
STEPS = [5, 25, 50, 100]  # a four-step plan (params.yaml's default before issue 16)
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
ROUTE = dict(gateway="inference-gateway", namespace="llm", port=8000)


def split(doc: dict) -> dict[str, int]:
    """{service: weight} of a route's one rule."""
    [rule] = doc["spec"]["rules"]
    return {ref["name"]: ref["weight"] for ref in rule["backendRefs"]}


def test_one_route_per_step_then_rollback_with_exact_weights():
    docs = list(yaml.safe_load_all(yaml.safe_dump_all(http_routes(MODEL, "1", "2", STEPS, **ROUTE))))
    stable, candidate = f"{MODEL}-v1", f"{MODEL}-v2"
    assert [split(d) for d in docs] == [
        {stable: 95, candidate: 5},
        {stable: 75, candidate: 25},
        {stable: 50, candidate: 50},
        {stable: 0, candidate: 100},
        {stable: 100, candidate: 0},  # rollback
    ]
    for i, d in enumerate(docs):
        step = str(i + 1) if i < len(STEPS) else "rollback"
        assert (d["apiVersion"], d["kind"]) == ("gateway.networking.k8s.io/v1", "HTTPRoute")
        meta = d["metadata"]
        assert (meta["name"], meta["namespace"]) == (MODEL, "llm")  # one route, re-applied per step
        assert meta["labels"] == {
            "app.kubernetes.io/name": MODEL,
            "app.kubernetes.io/managed-by": "quantgate",
            "quantgate/stable-version": "1",
            "quantgate/candidate-version": "2",
            "quantgate/step": step,
        }
        percent = STEPS[i] if i < len(STEPS) else 0
        assert meta["annotations"] == {
            "quantgate/model": MODEL,
            "quantgate/step": f"{step}/4" if i < len(STEPS) else "rollback",
            "quantgate/candidate-percent": str(percent),
        }
        assert d["spec"]["parentRefs"] == [{"name": "inference-gateway", "namespace": "llm"}]
        [rule] = d["spec"]["rules"]
        assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
        assert [(r["kind"], r["port"]) for r in rule["backendRefs"]] == [("Service", 8000)] * 2
        assert all(isinstance(r["weight"], int) for r in rule["backendRefs"])
        assert all(DNS_LABEL.fullmatch(n) for n in [meta["name"], *split(d)])


def test_fractional_percents_are_exact_out_of_10000_and_more_decimals_refused():
    assert weights(5) == (95, 5) and weights(5.0) == (95, 5) and weights(0) == (100, 0)
    assert weights(0.5) == (9950, 50) and weights(12.25) == (8775, 1225) and weights(0.29) == (9971, 29)
    with pytest.raises(QuantgateError, match=r"step 0.125%: Gateway API weights are integers; .* at most 2 decimals"):
        weights(0.125)
    docs = http_routes(MODEL, "1", "2", [0.5, 10, 100], **ROUTE)
    assert [split(d)[f"{MODEL}-v2"] for d in docs] == [50, 10, 100, 0]
    assert docs[0]["metadata"]["annotations"]["quantgate/candidate-percent"] == "0.5"


def test_service_names_are_dns_labels_or_refused():
    assert service_name("HuggingFaceTB/SmolLM2-135M-Instruct", "3") == "huggingfacetb-smollm2-135m-instruct-v3"
    assert service_name(MODEL, "3", "{model}-v{version}-predictor") == f"{MODEL}-v3-predictor"
    for model, template in [("a" * 61, "{model}-v{version}"), (MODEL, "{version}"), ("7b-chat", "{model}-{version}")]:
        with pytest.raises(QuantgateError, match=r"service name .* not a DNS label \(a letter first, .* 63 char"):
            service_name(model, "1", template)
    with pytest.raises(QuantgateError, match="model name '__' gives '', not a DNS label"):
        http_routes("__", "1", "2", STEPS, **ROUTE)
    with pytest.raises(QuantgateError, match=r"service template '\{name\}-\{version\}': use only"):
        service_name(MODEL, "1", "{name}-{version}")
    with pytest.raises(QuantgateError, match="namespace 'Prod' is not a DNS label"):
        http_routes(MODEL, "1", "2", STEPS, **(ROUTE | {"namespace": "Prod"}))
    # a Gateway's name is a DNS subdomain, as Kubernetes names it: dots allowed (refused before), 253 at most
    routes = http_routes(MODEL, "1", "2", STEPS, **(ROUTE | {"gateway": "gw.prod-1"}))
    assert routes[0]["spec"]["parentRefs"][0]["name"] == "gw.prod-1"
    for bad in ("gw..prod", "Gw.prod", "gw.", "a" * 254):
        with pytest.raises(QuantgateError, match="gateway '.*' is not a DNS subdomain"):
            http_routes(MODEL, "1", "2", STEPS, **(ROUTE | {"gateway": bad}))
    with pytest.raises(QuantgateError, match="v1 is already the stable build"):
        http_routes(MODEL, "1", "1", STEPS, **ROUTE)


@pytest.fixture(scope="module")
def sqlite_registry(tmp_path_factory) -> Path:
    """A project folder with a sqlite registry: fp16 = v1 (`fallback`), int4 = v2 and fp8 = v3
    (approved), int8 = v4 (PASS, not approved)."""
    root = tmp_path_factory.mktemp("render")
    return tiny_registry(root, f"sqlite:///{root}/mlflow.db")


def tiny_registry(root: Path, uri: str) -> Path:
    """The registry of `sqlite_registry` (tiny safetensors builds, versions 1-4) at tracking URI
    `uri` (sqlite, or an `mlflow server`), its project folder `root`."""
    models = root / "models"
    for seed, build in enumerate(("fp16", "int4", "fp8", "int8")):
        safetensors_build(models / build, build, seed, 1)
    (root / "params.yaml").write_text("register: {}\ncanary:\n  steps: [5, 25, 50, 100]\n")
    (root / "dvc.lock").write_text("schema: '2.0'\n")
    (root / "results/eval").mkdir(parents=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        out = register(
            models,
            gate_result({"int4": "PASS", "fp8": "PASS", "int8": "PASS"}),
            "# report",
            root / "results/eval",
            RegisterParams(model_name=MODEL, experiment="builds"),
            {"search": team_summary("5e" * 32)},
        )
        assert [out["builds"][b]["version"] for b in ("fp16", "int4", "fp8", "int8")] == ["1", "2", "3", "4"]
        client = store.client()
        for v in ("2", "3"):
            approval.approve(client, MODEL, v, "alice", "gate PASS")
    return root


@pytest.fixture
def project(sqlite_registry, monkeypatch):
    """The registry's folder as the working directory; aliases reset to fallback = v1 only."""
    monkeypatch.chdir(sqlite_registry)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{sqlite_registry}/mlflow.db")
    client = store.client()
    for alias in ("production", "previous", "candidate"):
        client.delete_registered_model_alias(MODEL, alias)
    client.set_registered_model_alias(MODEL, "fallback", "1")
    return client


def render(*args: str):
    return CliRunner().invoke(cli, ["canary", "render", MODEL, *args])


def one_line_error(result, message: str) -> None:
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [f"Error: {message}"]


def test_an_empty_out_is_refused_not_taken_as_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # refused while parsing: no registry, nothing written
    result = render("3", "--format", "gateway-api", "--out", "")
    assert result.exit_code == 2 and "Traceback" not in result.output  # a usage error, as --help says
    assert (
        result.output.splitlines()[-1] == "Error: Invalid value for '--out': the path is empty; give a file or folder"
    )
    assert list(tmp_path.iterdir()) == []


def test_render_against_fallback_when_there_is_no_production(project):
    result = render("2", "--format", "gateway-api", "--namespace", "llm")
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.output))
    assert [split(d) for d in docs][:2] == [
        {f"{MODEL}-v1": 95, f"{MODEL}-v2": 5},
        {f"{MODEL}-v1": 75, f"{MODEL}-v2": 25},
    ]
    assert len(docs) == 5 and {d["metadata"]["namespace"] for d in docs} == {"llm"}
    assert aliases.current(project, MODEL) == {"fallback": "1"}  # rendering changes nothing


def test_render_against_production_one_step_to_a_file(project, tmp_path):
    project.set_registered_model_alias(MODEL, "production", "2")
    out = tmp_path / "route.yaml"
    result = render("v3", "--format", "gateway-api", "--step", "2", "--port", "8080", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert f"wrote 1 HTTPRoute(s) for {MODEL} v2 -> v3 to {out}" in result.output
    [doc] = yaml.safe_load_all(out.read_text())
    assert split(doc) == {f"{MODEL}-v2": 75, f"{MODEL}-v3": 25}
    assert {r["port"] for r in doc["spec"]["rules"][0]["backendRefs"]} == {8080}
    [rollback] = yaml.safe_load_all(render("3", "--format", "gateway-api", "--step", "rollback").output)
    assert split(rollback) == {f"{MODEL}-v2": 100, f"{MODEL}-v3": 0}


def test_render_refusals_are_one_line(project, tmp_path):
    one_line_error(
        render("9", "--format", "gateway-api"),
        f"{MODEL} v9 does not exist (never registered, or deleted); see `quantgate status {MODEL}`",
    )
    one_line_error(
        render("4", "--format", "gateway-api"),
        f"{MODEL} v4: not approved (no `approval` tag); a release manager approves with "
        f"`quantgate approve {MODEL} 4 --reason ...`",
    )
    project.set_registered_model_alias(MODEL, "production", "2")
    for same in ("2", "v2", "002"):  # a zero-padded number is the same version, not a new Service name
        one_line_error(
            render(same, "--format", "gateway-api"),
            f"{MODEL} v2 already is the stable build (production); nothing to canary",
        )
    project.delete_registered_model_alias(MODEL, "fallback")
    one_line_error(
        render("3", "--format", "gateway-api"),
        f"{MODEL} has no `fallback` alias (the 16-bit build); run `dvc repro` first",
    )
    project.set_registered_model_alias(MODEL, "fallback", "1")
    one_line_error(
        render("3", "--format", "gateway-api", "--step", "5"),
        "--step 5: the canary policy has 4 steps (params.yaml canary.steps); give a step from 1 to 4, or rollback",
    )
    result = render("3", "--format", "gateway-api", "--out", str(tmp_path))  # a directory
    one_line_error(result, f"cannot write {tmp_path}: Is a directory; give a writable --out")
    result = render("3", "--format", "gateway-api", "--out", str(tmp_path / "missing" / "route.yaml"))
    assert result.exit_code == 1 and "No such file or directory; give a writable --out" in result.output
    # a bad --format or --step is a click usage error (exit 2) naming the option, as for every command
    for args, message in [
        (("--format", "istio"), "Invalid value for '--format': 'istio' is not 'gateway-api'."),
        (("--format", "gateway-api", "--step", "0"), "Invalid value for '--step': '0': give a step number"),
        (("--format", "gateway-api", "--step", "²"), "Invalid value for '--step': '²': give a step number"),
    ]:
        result = render("3", *args)
        assert result.exit_code == 2 and "Traceback" not in result.output
        assert result.output.strip().splitlines()[-1].startswith(f"Error: {message}")


@pytest.mark.parametrize(
    "template", ["{model}", "static-name", "{version.real}", "{model[0]}-{version}", "{model}-{version:x}"]
)
def test_service_templates_that_cannot_tell_the_versions_apart_are_refused(template):
    with pytest.raises(QuantgateError, match="use only {model} and {version}"):
        service_name("smollm2", "2", template)


def test_a_format_spec_a_name_can_take_is_kept():
    """`{model:.7}` (a name cut short) is a legitimate template: only specs no string takes are refused."""
    assert service_name("smollm2-135m", "12", "{model:.7}-v{version:>3}") == "smollm2-v-12"
    assert service_name("m", "12", "{model}{version:0>62}") == "m" + "0" * 60 + "12"  # a width up to a label's 63


@pytest.mark.parametrize("template", ["{model", "{version}}", "v{version}-}"])
def test_service_templates_with_unbalanced_braces_are_refused_in_one_line(project, template):
    with pytest.raises(QuantgateError, match=r"service template .*: (expected '\}'|Single '\}')"):
        service_name("smollm2", "2", template)
    result = render("2", "--format", "gateway-api", "--service", template)
    assert result.exit_code == 2 and result.output.splitlines()[-1] == (  # a usage error: the registry is not read
        f"Error: Invalid value for '--service': {template!r}: "
        + ("expected '}' before end of string" if template == "{model" else "Single '}' encountered in format string")
        + "; e.g. {model}-v{version}"
    ), result.output


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("--namespace", "BAD NS", "'BAD NS' is not a DNS label"),
        ("--namespace", "-llm", "'-llm' is not a DNS label"),
        ("--gateway", "", "'' is not a DNS subdomain"),
        ("--gateway", "gw..prod", "'gw..prod' is not a DNS subdomain"),
        ("--service", "{nope}", "'{nope}': use only {model} and {version}"),
        ("--service", "{model}", "'{model}': use only {model} and {version}, and {version} at least"),
        # exit 1 after the registry read before: str's format specs fail alike for every name
        (
            "--service",
            "{model}-v{version:d}",
            "'{model}-v{version:d}': Unknown format code 'd' for object of type 'str'",
        ),
        ("--service", "{model:=5}-{version}", "'{model:=5}-{version}': '=' alignment not allowed in string format"),
        # it made a string of that size before dns_label refused it (a gigabyte, or int()'s digit limit)
        (
            "--service",
            "{model}-{version:1000000000}",
            "'{model}-{version:1000000000}': a width of 1000000000 characters",
        ),
        ("--service", "{version:>64}", "'{version:>64}': a width of 64 characters; a Service name has at most 63"),
        ("--service", "{version:" + "9" * 5000 + "}", "'{version:" + "9" * 5000 + "}': a width of " + "9" * 5000),
        # a placeholder inside a spec: {nope} there escaped the name check (a KeyError traceback), and {model} there
        # was filled with the check's own stand-in ("Unknown format code 'm'")
        *(
            ("--service", t, f"'{t}': a placeholder inside a format spec; use only {{model}} and {{version}}")
            for t in ("{model}-{version:{nope}}", "{version:{0}}", "{version:{model.x}}", "{version:>{model}}")
        ),
    ],
)
def test_a_bad_gateway_namespace_or_service_is_a_usage_error_before_the_registry(
    tmp_path, monkeypatch, option, value, said
):
    """They exited 1, after the registry was read, although no registry can make them right."""
    monkeypatch.chdir(tmp_path)  # no registry here: a refusal that reached it would say so instead
    result = render("2", "--format", "gateway-api", option, value)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.splitlines()[-1].startswith(f"Error: Invalid value for '{option}': {said}"), result.output
    if option == "--namespace":
        assert result.output.splitlines()[-1].endswith(
            "(lowercase [a-z0-9-], a letter or digit first and last, at most 63 characters); give the name as the "
            "cluster has it"
        )
    if option == "--gateway":
        assert result.output.splitlines()[-1].endswith(
            "(lowercase [a-z0-9-] labels joined by dots, each a letter or digit first and last, at most 253 "
            "characters); give the name as the cluster has it"
        )
    assert list(tmp_path.iterdir()) == []


def test_the_routes_are_a_traffic_split_like_the_gateways():
    """One interface moves a canary's traffic (canary/traffic.py): the gateway's admin client, a router in this
    process and the Gateway API routes all implement it; the routes' split writes one YAML route per weight."""
    from canary.render import RouteSplit
    from canary.traffic import TrafficSplit
    from gateway.admin import RemoteRouter
    from gateway.router import Router

    written = []
    routes = RouteSplit(MODEL, "1", "3", STEPS, write=lambda doc: written.append(yaml.safe_dump(doc)), **ROUTE)
    assert all(issubclass(kind, TrafficSplit) for kind in (RemoteRouter, Router, RouteSplit))
    assert isinstance(routes, TrafficSplit)
    routes.set_weight(25)
    routes.drain()
    docs = [yaml.safe_load(text) for text in written]
    stable, candidate = service_name(MODEL, "1"), service_name(MODEL, "3")
    assert [split(d) for d in docs] == [{stable: 75, candidate: 25}, {stable: 100, candidate: 0}]
    assert [d["metadata"]["labels"]["quantgate/step"] for d in docs] == ["2", "rollback"]
    assert routes.samples_since(0) == [] and routes.shadows_since(0) == []  # the cluster's metrics judge there
    with pytest.raises(QuantgateError, match=r"^30% is not a step of the policy"):
        routes.set_weight(30)
