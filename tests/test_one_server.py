"""One vLLM server per build for evaluate@<build> and profile@<build> (pipeline/measuring.py,
pipeline/team_scores.py): whichever stage runs first starts the server, measures the build before any team is
scored on it, scores the teams, and keeps both in the content caches; the other stage then starts no server.
The servers, vLLM's benchmark and lm-eval are stand-ins here; the real run is the e2e project (tests/test_e2e.py)."""

import json
from contextlib import contextmanager
from pathlib import Path

import pytest

import pipeline.evaluate as evaluate_stage
import pipeline.measuring as measuring
import pipeline.profile as profile_stage
import pipeline.team_scores as team_scores
from pipeline.evaluate import EvaluateParams, evaluate
from pipeline.team_scores import score_for_evaluate
from quantgate.errors import QuantgateError
from quantgate.precision import Platform
from quantgate.profile_params import ProfileParams
from quantgate.results import ServingRecord, TeamScores
from quantgate.serving import ServeParams, Server, ServerStartError
from tests.conftest import safetensors_build

TEAMS = ["billing", "search", "support"]
PROFILE = ProfileParams(concurrency=[1, 8])


@pytest.fixture
def one_build(tmp_path, example_evals, monkeypatch):
    """An int8 build (tiny safetensors) in a project folder, the example teams, both caches in the project, and
    stand-ins for the serving env (fixed precision and serving record), vLLM's benchmark and lm-eval. `events`
    lists what happened, in order: ("start", stage), ("bench", concurrency), ("score", team)."""
    monkeypatch.chdir(tmp_path)
    model = safetensors_build(tmp_path / "models" / "int8", "int8", seed=3, shards=1)
    events = []
    precision = {"dtype": "bfloat16", "requested": "auto", "why": "auto: test"}
    record = ServingRecord(versions={"vllm": "test"}, dtype="bfloat16", max_model_len=2048, extra_args=[])
    monkeypatch.setattr(team_scores, "serving_config", lambda *a: (precision, record, None))  # both stages ask it
    monkeypatch.setattr(team_scores, "make_lm", lambda server, *a: server)
    failing = set()
    profiles = []  # profiles in the cache when each team was scored

    def run_team(lm, team, harness):
        events.append(("score", team.name))
        profiles.append(len(list(measuring.CACHE_DIR.glob("*.json"))) if measuring.CACHE_DIR.exists() else 0)
        if team.name in failing:
            raise RuntimeError(f"{team.name} broke")
        return TeamScores(status="ok"), [{"doc_id": 0}]

    monkeypatch.setattr(team_scores, "run_team", run_team)
    auto = {"dtype": "bfloat16", "enforce_eager": True, "kv_cache_gib": 2.0}
    monkeypatch.setattr(measuring, "resolved", lambda p, model_dir=None: p.model_construct(**{**dict(p), **auto}))
    monkeypatch.setattr(measuring, "probe", lambda python: Platform(device="cpu", native_bf16=True))
    monkeypatch.setattr(measuring, "probe_key", lambda python: "cpu-flags-and-env")
    monkeypatch.setattr(measuring, "arithmetic_kv", lambda *a: {"kv_tokens_arithmetic": 23_301})
    monkeypatch.setattr(measuring, "tree_rss_gib", lambda pid: 1.25)

    def bench_loads(python, base_url, name, tokenizer, points, load, out_dir):
        events.extend(("bench", c) for c, _ in points)
        return [
            {
                "output_throughput": 10.0 * c,
                "request_throughput": 0.5 * c,
                "p50_ttft_ms": 100.0,
                "p99_ttft_ms": 150.0,
                "p50_tpot_ms": 70.0,
                "p99_tpot_ms": 90.0,
            }
            for c, _ in points
        ]

    monkeypatch.setattr(measuring, "bench_loads", bench_loads)

    def server_for(stage: str):
        @contextmanager
        def server(params, model_dir, name, log_path):
            events.append(("start", stage))
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_path.write_text("GPU KV cache size: 23,296 tokens\n")
            yield Server(base_url="http://127.0.0.1:1/v1", name=name, log_path=log_path, pid=0)

        return server

    monkeypatch.setattr(evaluate_stage, "vllm_server", server_for("evaluate"))
    monkeypatch.setattr(profile_stage, "vllm_server", server_for("profile"))
    return model, example_evals, events, failing, profiles


def scores_alongside(model, evals):
    return lambda server: score_for_evaluate(server, "int8", model, evals, EvaluateParams())


def test_evaluate_first_measures_the_build_before_scoring_and_profile_then_starts_no_server(one_build, capsys):
    model, evals, events, _, profiles = one_build
    docs = evaluate("int8", model, evals, Path("results/eval/int8"), EvaluateParams(), profiling=PROFILE)
    assert {t: d.status for t, d in docs.items()} == dict.fromkeys(TEAMS, "ok")
    # the benchmark ran on a server that had answered no team yet
    assert events == [("start", "evaluate"), ("bench", 1), ("bench", 8), *(("score", t) for t in TEAMS)]
    timing = json.loads(Path("results/eval/int8/timing.json").read_text())
    assert timing["profile_s"] >= 0 and set(timing["scoring_s"]) == set(TEAMS)
    assert profiles == [1, 1, 1]
    events.clear()
    rec = profile_stage.measured("int8", model, ServeParams(), PROFILE, scores_alongside(model, evals))
    assert events == []  # no server, no benchmark, no scoring
    assert (rec.status, rec.build, rec.measured_on, rec.measured_as) == ("profiled", "int8", "evaluate@int8", None)
    assert rec.loads["c8"].output_tokens_per_s == 80.0 and rec.kv_tokens == 23_296 and rec.server_rss_gib == 1.25
    assert "profile[int8]: from cache" in capsys.readouterr().out
    # evaluate again (a team's margin changed, say): every team from the cache, no server
    evaluate("int8", model, evals, Path("results/eval/int8"), EvaluateParams(), profiling=PROFILE)
    assert events == []


def test_profile_first_scores_the_teams_for_evaluate_which_then_scores_only_what_failed_there(one_build, capsys):
    model, evals, events, failing, profiles = one_build
    failing.add("search")
    rec = profile_stage.measured("int8", model, ServeParams(), PROFILE, scores_alongside(model, evals))
    assert rec.status == "profiled" and rec.measured_on is None
    assert events == [("start", "profile"), ("bench", 1), ("bench", 8), *(("score", t) for t in TEAMS)]
    said = capsys.readouterr().out
    assert "profile[int8]: search: not scored here (RuntimeError: search broke); left to evaluate@int8" in said
    assert "profile[int8]: billing: kept for evaluate@int8" in said
    assert len(list(team_scores.CACHE_DIR.iterdir())) == 2  # an error is never cached
    assert profiles == [1, 1, 1]  # the figures were kept before any team was scored: a stop then loses only scores
    assert not Path("results/eval").exists()  # the profile stage writes only its own out (and the caches)
    events.clear()
    failing.clear()
    docs = evaluate("int8", model, evals, Path("results/eval/int8"), EvaluateParams(), profiling=PROFILE)
    assert events == [("start", "evaluate"), ("score", "search")]  # the profile was cached: measured once
    assert {t: d.status for t, d in docs.items()} == dict.fromkeys(TEAMS, "ok")
    assert json.loads(Path("results/eval/int8/timing.json").read_text())["cached"] == ["billing", "support"]
    # the teams scored on profile's server are recorded as scored here, as evaluate's own are
    billing = TeamScores.model_validate_json(Path("results/eval/int8/billing/scores.json").read_text())
    assert billing.build == "int8" and billing.placement[0].executor == "local" and billing.serving.dtype == "bfloat16"


def test_a_profile_on_other_cores_is_not_evaluates_server_and_is_measured_on_its_own(one_build):
    model, evals, events, *_ = one_build
    other = PROFILE.model_copy(update={"cpu_cores": "1"})
    evaluate("int8", model, evals, Path("results/eval/int8"), EvaluateParams(), profiling=other)
    assert ("bench", 1) not in events and not measuring.CACHE_DIR.exists()
    assert "profile_s" not in json.loads(Path("results/eval/int8/timing.json").read_text())  # nothing measured
    events.clear()
    assert profile_stage.measured("int8", model, ServeParams(), other).measured_on is None
    assert events == [("start", "profile"), ("bench", 1), ("bench", 8)]


def test_a_benchmark_that_fails_on_evaluates_server_costs_no_team_and_leaves_the_profile_to_its_stage(
    one_build, monkeypatch, capsys
):
    model, evals, events, *_ = one_build
    monkeypatch.setattr(
        measuring, "bench_loads", lambda *a: (_ for _ in ()).throw(measuring.QuantgateError("bench broke"))
    )
    docs = evaluate("int8", model, evals, Path("results/eval/int8"), EvaluateParams(), profiling=PROFILE)
    assert {t: d.status for t, d in docs.items()} == dict.fromkeys(TEAMS, "ok")
    assert "profile[int8]: not measured on evaluate's server (bench broke); profile@int8 will measure it" in (
        capsys.readouterr().out
    )
    assert not measuring.CACHE_DIR.exists()
    timing = json.loads(Path("results/eval/int8/timing.json").read_text())
    assert "profile_s" not in timing and timing["profile_failed_s"] >= 0  # what the failure cost, named as such


def test_the_profile_stage_scores_for_evaluate_without_registry_and_cloud_credentials(monkeypatch, tmp_path):
    import os

    from quantgate.results import BuildProfile

    monkeypatch.chdir(tmp_path)
    Path("evals").mkdir()
    Path("params.yaml").write_text("profile: {}\nevaluate: {serve: {}}\nexecutor: {}\n")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "p")
    seen = {}

    def measured(build, model_dir, serve, params, alongside, timing):
        seen.update(env=dict(os.environ), alongside=alongside)
        return BuildProfile(build=build, status="unprofiled", reason="stand-in", input_len=32, output_len=16, seed=1)

    monkeypatch.setattr(profile_stage, "measured", measured)
    monkeypatch.setattr("sys.argv", ["profile", "int8", "models/int8", "evals", "results/profile/int8.json"])
    profile_stage.main()
    assert not {"AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD"} & set(seen["env"])
    assert seen["env"]["HF_HUB_OFFLINE"] == "1" and callable(seen["alongside"])
    assert json.loads(Path("results/profile/int8.json").read_text())["reason"] == "stand-in"
    # a build evaluate scores on a remote endpoint: nothing to score alongside
    Path("params.yaml").write_text(
        "profile: {}\nexecutor: {}\nevaluate:\n  serve: {}\n  endpoints:\n"
        "    int8: {url: 'http://10.0.0.1:8000/v1', dtype: bfloat16}\n"
    )
    profile_stage.main()
    assert seen["alongside"] is None
    # the stage's own timing, beside its logs (benchmarks read it): nothing started by the stand-in
    timing = json.loads(Path("results/logs/profile@int8.timing.json").read_text())
    assert timing == {"build": "int8", "server_start_s": 0.0, "profile_s": None, "scoring_s": {}}
    # an evals folder that is not there is refused before any server starts
    Path("params.yaml").write_text("profile: {}\nevaluate: {serve: {}}\nexecutor: {}\n")
    monkeypatch.setattr("sys.argv", ["profile", "int8", "models/int8", "no-evals", "results/profile/int8.json"])
    seen.clear()
    with pytest.raises(QuantgateError, match=r"^no-evals: not a folder of team eval sets; give the evals folder"):
        profile_stage.main()
    assert seen == {}  # refused before the measurement (and its server) was asked for


def test_a_profile_on_other_cores_scores_no_team_for_evaluate(one_build, capsys):
    model, evals, events, *_ = one_build
    other = PROFILE.model_copy(update={"cpu_cores": "1"})
    profile_stage.measured("int8", model, ServeParams(), other, scores_alongside(model, evals))
    assert events == [("start", "profile"), ("bench", 1), ("bench", 8)]  # not evaluate's server: no team on it
    assert "profile.cpu_cores is not evaluate.serve's: no team scored here" in capsys.readouterr().out
    assert not team_scores.CACHE_DIR.exists()


def test_a_measurement_that_breaks_unexpectedly_on_evaluates_server_costs_no_team(one_build, monkeypatch, capsys):
    model, evals, events, *_ = one_build
    monkeypatch.setattr(measuring, "bench_loads", lambda *a: [{"output_throughput": 1.0}] * 2)  # keys missing
    docs = evaluate("int8", model, evals, Path("results/eval/int8"), EvaluateParams(), profiling=PROFILE)
    assert {t: d.status for t, d in docs.items()} == dict.fromkeys(TEAMS, "ok")
    assert "not measured on evaluate's server (KeyError: 'request_throughput')" in capsys.readouterr().out
    assert not measuring.CACHE_DIR.exists()


def test_a_builds_own_cached_profile_is_written_byte_for_byte_as_measured(one_build, tmp_path):
    from quantgate.results import write_profile

    model, evals, events, *_ = one_build
    first = profile_stage.measured("int8", model, ServeParams(), PROFILE, scores_alongside(model, evals))
    again = profile_stage.measured("int8", model, ServeParams(), PROFILE, scores_alongside(model, evals))
    write_profile(tmp_path / "first.json", first)
    write_profile(tmp_path / "again.json", again)
    assert (tmp_path / "first.json").read_bytes() == (tmp_path / "again.json").read_bytes()
    assert again.measured_as is None


def test_a_scalar_evaluate_block_is_named_as_such_where_the_profile_stage_reads_its_serve_block(tmp_path):
    from quantgate.params import load_block
    from quantgate.serving import ServeParams

    (tmp_path / "params.yaml").write_text("profile: {}\nevaluate: 3\n")
    with pytest.raises(QuantgateError) as err:
        load_block("evaluate.serve", ServeParams, tmp_path / "params.yaml")
    assert str(err.value) == f"{tmp_path}/params.yaml:2: evaluate must be a mapping (of serve, ...); got int 3"
    (tmp_path / "params.yaml").write_text("profile: {}\nevaluate: {harness: {}}\n")  # a block that is not there
    with pytest.raises(QuantgateError, match=r"no block 'evaluate.serve' \(missing 'serve'\)"):
        load_block("evaluate.serve", ServeParams, tmp_path / "params.yaml")


def test_the_profile_stage_times_its_server_its_measurement_and_the_teams_it_scores(one_build, monkeypatch):
    import itertools
    import shutil
    from types import SimpleNamespace

    model, evals, events, *_ = one_build
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # the stage sets them: undone after the test
        monkeypatch.setenv(var, "1")
    Path("params.yaml").write_text("profile: {concurrency: [1, 8]}\nevaluate: {serve: {}}\nexecutor: {}\n")
    monkeypatch.setattr("sys.argv", ["profile", "int8", str(model), str(evals), "results/profile/int8.json"])
    logged = Path("results/logs/profile@int8.timing.json")

    def run():  # a clock that moves 10 s per reading: started, ready, measured
        monkeypatch.setattr(profile_stage, "time", SimpleNamespace(monotonic=itertools.count(0.0, 10.0).__next__))
        profile_stage.main()
        return json.loads(logged.read_text())

    timing = run()
    assert events == [("start", "profile"), ("bench", 1), ("bench", 8), *(("score", t) for t in TEAMS)]
    assert timing["server_start_s"] == 10.0 and timing["profile_s"] == 10.0 and set(timing["scoring_s"]) == set(TEAMS)
    # a server that starts and then fails the measurement still cost its start; nothing was measured
    shutil.rmtree(measuring.CACHE_DIR)
    monkeypatch.setattr(measuring, "bench_loads", lambda *a: (_ for _ in ()).throw(QuantgateError("bench broke")))
    failed = {"build": "int8", "server_start_s": 10.0, "profile_s": None, "profile_failed_s": 10.0, "scoring_s": {}}
    assert run() == failed
    # a server that does not start costs the seconds until it failed, as evaluate records them
    monkeypatch.setattr(profile_stage, "vllm_server", lambda *a: (_ for _ in ()).throw(ServerStartError("no start")))
    assert run() == {"build": "int8", "server_start_s": 10.0, "profile_s": None, "scoring_s": {}}
    # on Ray the stage writes no timing, and leaves none from a local run for the benchmarks to read
    monkeypatch.setattr(profile_stage, "profile_on_ray", lambda build, *a: profile_stage.measured(build, *a[:3]))
    Path("params.yaml").write_text("profile: {concurrency: [1, 8]}\nevaluate: {serve: {}}\nexecutor: {kind: ray}\n")
    profile_stage.main()
    assert not logged.exists()


def test_what_fails_on_the_server_after_the_measurement_leaves_the_figures_kept(one_build, capsys):
    model, evals, events, *_ = one_build

    def alongside(server):
        events.append(("alongside", server.name))
        raise QuantgateError("scoring broke")

    rec = profile_stage.measured("int8", model, ServeParams(), PROFILE, alongside)
    assert rec.status == "profiled" and events[-1] == ("alongside", "int8")
    assert "profile[int8]: after the measurement: scoring broke" in capsys.readouterr().out
    assert len(list(measuring.CACHE_DIR.glob("*.json"))) == 1  # kept before the scoring failed
