"""Remote evaluation endpoints (evaluate.endpoints): the identity check against a fake OpenAI server
(GET /v1/models, /version shaped as vLLM 0.32 answers them), its one-line refusals, and the evaluate
stage scoring a checked endpoint instead of starting a server. The real vLLM run is tests/test_endpoint_e2e.py."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import pipeline.evaluate as stage
import pipeline.team_scores as team_scores
from quantgate.errors import QuantgateError
from quantgate.params import load_block
from quantgate.serving import Endpoint, Server, check_endpoint, free_port, served_max_model_len, served_name
from tests.conftest import safetensors_build

DIGEST = "ab" * 32
OTHER = "cd" * 32


@pytest.fixture
def fake_vllm():
    """A fake vLLM OpenAI server on loopback; set `.ids` to the served model names, `.status` to the
    /v1/models HTTP status. Yields the server; `.url` is its /v1 base URL; `.auth` the headers seen."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            server.auth.append(self.headers.get("Authorization"))
            if self.path == "/v1/models":
                cards = [{"id": i, "object": "model", "root": "/models/x", "max_model_len": 1024} for i in server.ids]
                body, status = {"object": "list", "data": cards}, server.status
            elif self.path == "/version":
                body, status = {"version": "0.32.0"}, 200
            else:
                body, status = {"detail": "Not Found"}, 404
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.ids, server.status, server.auth = [served_name("int4", DIGEST)], 200, []
    server.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def endpoint(url: str) -> Endpoint:
    return Endpoint(url=url, dtype="bfloat16", timeout_s=2)


def test_the_right_build_is_accepted_with_its_evidence(fake_vllm):
    got = check_endpoint("int4", DIGEST, endpoint(fake_vllm.url + "/"), api_key="k")
    assert {k: got[k] for k in ("url", "served", "root", "max_model_len", "vllm")} == {
        "url": fake_vllm.url,
        "served": "int4@sha256:" + DIGEST,
        "root": "/models/x",
        "max_model_len": 1024,
        "vllm": "0.32.0",
    }
    assert fake_vllm.auth == ["Bearer k", "Bearer k"]  # OPENAI_API_KEY reaches a deployment run with --api-key


@pytest.mark.parametrize(
    "ids, serves",
    [
        ([served_name("fp8", DIGEST)], f"serves fp8@sha256:{DIGEST};"),  # another build
        ([served_name("int4", OTHER)], f"serves int4@sha256:{OTHER}, another int4 build (weights differ);"),
        (["int4"], "serves int4 without its weights digest;"),  # a name without the digest
        ([], "serves no model;"),
    ],
)
def test_a_wrong_build_is_refused_in_one_line_naming_both(fake_vllm, ids, serves):
    fake_vllm.ids = ids
    with pytest.raises(QuantgateError) as err:
        check_endpoint("int4", DIGEST, endpoint(fake_vllm.url))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"evaluate.endpoints.int4: {fake_vllm.url} {serves}")
    assert msg.endswith(f"expected int4@sha256:{DIGEST} (vLLM --served-model-name); refused before scoring")


def test_unreachable_and_unauthorized_endpoints_are_one_line_in_seconds(fake_vllm):
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(QuantgateError, match=r"^evaluate.endpoints.int4: .* is unreachable \(ConnectError\); nothing"):
        check_endpoint("int4", DIGEST, endpoint(url))
    assert time.monotonic() - started < 3
    fake_vllm.status = 401
    with pytest.raises(QuantgateError, match=r"/v1/models answered HTTP 401 \(set OPENAI_API_KEY to the deployment"):
        check_endpoint("int4", DIGEST, endpoint(fake_vllm.url))


def test_endpoint_params_name_the_line_and_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(
        "builds: [fp16, int4]\nquantize: {int4: {recipe: r.yaml}}\nevaluate:\n  endpoints:\n"
        "    int4: {url: 10.0.0.5:8000, dtype: bfloat16}\n"
    )
    with pytest.raises(QuantgateError) as err:
        load_block("evaluate", stage.EvaluateParams)
    assert str(err.value).startswith("params.yaml:5: evaluate.endpoints.int4.url: '10.0.0.5:8000' is not")
    (tmp_path / "params.yaml").write_text(
        "builds: [fp16, int4]\nquantize: {int4: {recipe: r.yaml}}\nevaluate:\n  endpoints:\n"
        "    int5: {url: 'http://h:8000/v1', dtype: bfloat16}\n"
    )
    with pytest.raises(QuantgateError, match=r"^params.yaml:5: evaluate.endpoints.int5: not a build of this run"):
        stage.check_endpoint_builds(load_block("evaluate", stage.EvaluateParams), ["fp16", "int4"])


def test_evaluate_refuses_a_wrong_build_before_scoring_or_writing(fake_vllm, tmp_path, example_evals, monkeypatch):
    model = safetensors_build(tmp_path / "int4", "int4", seed=0, shards=1)
    fake_vllm.ids = [served_name("int4", OTHER)]
    monkeypatch.setattr(team_scores, "run_team", lambda *a: pytest.fail("scored"))
    params = stage.EvaluateParams(endpoints={"int4": endpoint(fake_vllm.url)})
    with pytest.raises(QuantgateError, match="another int4 build"):
        stage.evaluate("int4", model, example_evals, tmp_path / "out", params)
    assert not (tmp_path / "out").exists()


def test_evaluate_scores_a_checked_endpoint_and_records_it(fake_vllm, tmp_path, example_evals, monkeypatch):
    from quantgate.results import TeamScores

    model = safetensors_build(tmp_path / "int4", "int4", seed=0, shards=1)
    digest = json.loads((model / "build.json").read_text())["weights_digest"]
    fake_vllm.ids = [served_name("int4", digest)]
    monkeypatch.setattr(team_scores, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(stage, "vllm_server", lambda *a: pytest.fail("a local server was started"))
    monkeypatch.setattr(team_scores, "precision_record", lambda *a: pytest.fail("the local serving env was probed"))
    seen = []
    monkeypatch.setattr(team_scores, "make_lm", lambda server, model_dir, harness, max_length: (server, max_length))
    monkeypatch.setattr(team_scores, "run_team", lambda lm, team, h: seen.append(lm) or (TeamScores(status="ok"), []))
    out = tmp_path / "out"
    docs = stage.evaluate(
        "int4", model, example_evals, out, stage.EvaluateParams(endpoints={"int4": endpoint(fake_vllm.url)})
    )
    server, max_length = seen[0]
    assert (server.base_url, server.name, max_length) == (fake_vllm.url, f"int4@sha256:{digest}", 1024)
    assert sorted(docs) == ["billing", "search", "support"] and len(seen) == 3
    recorded = json.loads((out / "endpoint.json").read_text())
    assert recorded["url"] == fake_vllm.url and recorded["served"] == f"int4@sha256:{digest}"
    assert json.loads((out / "precision.json").read_text())["endpoint"] == fake_vllm.url
    scores = json.loads((out / "billing" / "scores.json").read_text())
    assert scores["serving"] == {
        "versions": {"vllm": "0.32.0"},
        "dtype": "bfloat16",
        "max_model_len": 1024,
        "extra_args": [],
        "endpoint": fake_vllm.url,
    }
    assert not (out / "server.log").exists()


def test_a_build_served_as_w4a8_is_not_scored_on_an_endpoint(fake_vllm, tmp_path, example_evals, monkeypatch):
    # a deployment publishes neither VLLM_CPU_INT4_W4A8 nor its kernel: its scores could be W4A16's
    model = safetensors_build(tmp_path / "int4-w4a8", "int4-w4a8", seed=0, shards=1)
    manifest = json.loads((model / "build.json").read_text())
    (model / "build.json").write_text(json.dumps(manifest | {"w4a8": True}))
    fake_vllm.ids = [served_name("int4-w4a8", manifest["weights_digest"])]
    monkeypatch.setattr(team_scores, "run_team", lambda *a: pytest.fail("scored"))
    params = stage.EvaluateParams(endpoints={"int4-w4a8": endpoint(fake_vllm.url)})
    with pytest.raises(QuantgateError, match=r"evaluate.endpoints.int4-w4a8: int4-w4a8 is served as W4A8 .*drop this"):
        stage.evaluate("int4-w4a8", model, example_evals, tmp_path / "out", params)
    assert not (tmp_path / "out").exists()


def test_max_model_len_minus_one_is_read_from_the_server(fake_vllm, tmp_path, monkeypatch):
    """evaluate.serve.max_model_len -1 (vLLM fits it at start) went to lm-eval as max_length -1, and every team
    failed with "prompt is N tokens > -2"; the length the server reports is used instead."""
    from lm_eval.models import openai_completions

    from quantgate.scoring import HarnessParams

    server = Server(base_url=fake_vllm.url, name=served_name("int4", DIGEST), log_path=tmp_path / "log")
    assert served_max_model_len(server) == 1024
    seen = {}
    monkeypatch.setattr(openai_completions, "LocalCompletionsAPI", lambda **kw: seen.update(kw))
    team_scores.make_lm(server, tmp_path, HarnessParams(), -1)
    assert seen["max_length"] == 1024
    team_scores.make_lm(server, tmp_path, HarnessParams(), 512)
    assert seen["max_length"] == 512
    other = Server(base_url=fake_vllm.url, name="int8", log_path=tmp_path / "log")
    with pytest.raises(QuantgateError, match=r"/v1/models: no max_model_len for int8 \(KeyError\), needed for"):
        served_max_model_len(other)
