"""pipeline.evaluate.run_team on a tiny model through lm-eval's in-process hf backend: the team
tasks load without lm-eval's built-in task index, and per-sample scores match lm-eval's aggregate."""

import pytest

from quantgate.scoring import HarnessParams, run_team
from quantgate.teams import load_teams
from tests.tiny import tiny_llama_dir


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from lm_eval.models.huggingface import HFLM

    return HFLM(
        pretrained=str(tiny_llama_dir(tmp_path_factory.mktemp("tiny"))),
        dtype="float32",
        device="cpu",
        batch_size=4,
        max_length=128,
    )


@pytest.mark.parametrize("team", ["search", "billing"])  # multiple choice (acc), generation (exact_match)
def test_run_team_scores_every_document_of_every_task(lm, example_evals, team, monkeypatch):
    import lm_eval.tasks

    built = []
    real = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kw: built.append(kw) or real(**kw))
    t = next(t for t in load_teams(example_evals) if t.name == team)
    doc, raw = run_team(lm, t, HarnessParams(limit=3))
    assert built == [{"include_defaults": False}]  # lm-eval's ~14,700 built-in tasks are not indexed
    [(task, summary)] = doc.tasks.items()
    assert task == t.tasks[0].name and summary.n == 3 and doc.status == "ok"
    scores = [s.score for s in doc.samples]
    assert [s.doc_id for s in doc.samples] == [0, 1, 2] and set(scores) <= {0.0, 1.0}
    assert summary.score == pytest.approx(sum(scores) / 3) and doc.metric == t.policy.metric
    assert len(raw) >= 3 and all(r["task"] == task for r in raw)


@pytest.mark.parametrize("team", ["search", "billing"])  # loglikelihood (choices), generation (max_gen_toks)
def test_prompts_longer_than_the_context_are_refused_not_cut(lm, example_evals, team):
    import json

    from quantgate.errors import QuantgateError

    data = example_evals / team / "data.jsonl"
    docs = [json.loads(line) for line in data.read_text().splitlines()]
    docs[1]["question"] = "Please answer carefully. " * 40 + docs[1]["question"]  # ~160 words: over 128 tokens
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    t = next(t for t in load_teams(example_evals) if t.name == team)
    with pytest.raises(QuantgateError) as err:
        run_team(lm, t, HarnessParams(limit=3))
    msg = str(err.value)
    assert msg.startswith("1 prompt(s) longer than the model's context, which lm-eval would cut: ")
    assert f"{t.tasks[0].name} doc 1: prompt is " in msg and "> 128; shorten those documents" in msg


def test_over_length_counts_context_plus_what_follows():
    from quantgate.scoring import over_length

    words = str.split  # one token per word
    raw = [
        {"task": "t", "doc_id": 0, "arguments": [("a b c", " d"), ("a b c", " d e")]},  # 3+1 ok, 3+2 over
        {"task": "t", "doc_id": 1, "arguments": [("a b", {"max_gen_toks": 2})]},  # 2+2 ok
        {"task": "t", "doc_id": 2, "arguments": [("a b c", {"until": ["\n"]})]},  # 3+default 2 over
        {"task": "t", "doc_id": 3, "arguments": [("a b c d e f",)]},
    ]  # rolling: skipped
    assert over_length(raw, words, 4, default_gen_toks=2) == [
        "t doc 0: prompt is 3 tokens + 2 of an answer choice > 4",
        "t doc 2: prompt is 3 tokens + 2 to generate > 4",
    ]


def test_arc_format_team_scores(lm, tmp_path):
    """lm-eval's ARC task format (tests/arc_evals, without its two bad documents) validates and scores."""
    import shutil

    from quantgate.teams import load_team
    from tests.conftest import REPO

    shutil.copytree(REPO / "tests" / "arc_evals", tmp_path / "evals")
    data = tmp_path / "evals" / "arcteam" / "arc.jsonl"
    lines = data.read_text().splitlines()
    data.write_text("".join(line + "\n" for n, line in enumerate(lines, 1) if n not in (17, 41)))
    doc, _ = run_team(lm, load_team(tmp_path / "evals" / "arcteam"), HarnessParams(limit=3))
    assert doc.status == "ok" and doc.tasks["arc_easy_local"].n == 3


def test_cache_key_follows_what_changes_scores_not_the_gate_policy(example_evals):
    from pipeline.team_scores import cache_key

    def key(harness=HarnessParams()):  # noqa: B008 - frozen, never mutated
        team = next(t for t in load_teams(example_evals) if t.name == "search")
        return cache_key("w" * 64, team, harness, {"dtype": "auto"}, "m" * 64)

    def edited(path, old, new):
        text = path.read_text()
        assert old in text
        path.write_text(text.replace(old, new))
        try:
            return key()
        finally:
            path.write_text(text)

    base, policy = key(), example_evals / "search" / "team.yaml"
    for old, new in [
        ("absolute: 0.05", "absolute: 0.06"),
        ("confidence: 0.95", "confidence: 0.9"),
        ("search-ml@example.com", "search@example.com"),
        ("owner: Search Relevance", "owner: Search"),
        ("higher_is_better: true", "higher_is_better: true  # as before"),
    ]:
        assert edited(policy, old, new) == base, old  # the gate re-judges the cached scores
    (example_evals / "search" / "NOTES.md").write_text("not read by lm-eval\n")
    assert key() == base
    changed = [
        edited(policy, "chat_template: false", "chat_template: true"),
        edited(policy, "confidence: 0.95", "confidence: 0.95\nlimit: 60"),
        edited(example_evals / "search" / "capitals.yaml", "version: 1.0", "version: 1.1"),
        edited(example_evals / "search" / "data.jsonl", "capital of France", "capital city of France"),
        key(HarnessParams(limit=30)),
    ]  # (limit 60 from either side is one key)
    assert len({base, *changed}) == 6


def test_evaluate_stage_runs_without_registry_and_cloud_credentials(monkeypatch):
    import os
    import sys

    import pipeline.evaluate as stage

    secrets = {
        "MLFLOW_TRACKING_URI": "postgresql://u:p@db/mlflow",
        "MLFLOW_TRACKING_PASSWORD": "p",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_ACCESS_KEY_ID": "a",
        "GOOGLE_APPLICATION_CREDENTIALS": "/k.json",
        "AZURE_CLIENT_SECRET": "s",
        "HF_TOKEN": "t",
        "DB_PASSWORD": "p",
    }
    kept = {"OPENAI_API_KEY": "remote-endpoint-key", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4"}
    for k, v in {**secrets, **kept}.items():
        monkeypatch.setenv(k, v)
    seen = {}
    monkeypatch.setattr(sys, "argv", ["evaluate", "fp8", "models/fp8", "evals", "results/eval/fp8"])
    monkeypatch.setattr(stage, "load_block", lambda key, model: model())  # evaluate and executor: defaults (local)
    monkeypatch.setattr(stage, "evaluate", lambda *a: seen.update(os.environ) or {})
    stage.main()  # the vLLM server the stage starts gets os.environ as it is then (quantgate/serving.py)
    assert not set(secrets) & set(seen) and all(seen[k] == v for k, v in kept.items())


def test_the_same_weights_served_as_w4a8_are_another_cache_entry(example_evals, tmp_path):
    # int4-w4a8 is int4's weights served with int8 activations: its scores are its own, never int4's cached ones;
    # int4-mixed with int4's weights and no serving setting is int4's entry (quantgate.manifest.config_digest)
    import json

    from pipeline.team_scores import cache_key
    from quantgate.manifest import config_digest

    team = next(t for t in load_teams(example_evals) if t.name == "search")
    keys = {}
    for name, settings in (("int4", {}), ("int4-mixed", {}), ("int4-w4a8", {"w4a8": True})):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
        (d / "build.json").write_text(json.dumps({"build": name, "weights_digest": "w" * 64, **settings}))
        keys[name] = cache_key("w" * 64, team, HarnessParams(), {"dtype": "bfloat16"}, config_digest(d))
    assert keys["int4-mixed"] == keys["int4"] != keys["int4-w4a8"]
