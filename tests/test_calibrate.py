"""The calibrate stage's checks and packing, on the example team sets and a tiny tokenizer (no server).
Team calibration files: tests/test_calibration.py."""

import json
import shutil
from pathlib import Path

import pytest

import pipeline.calibrate as cal
from quantgate.calibration import eval_strings
from quantgate.errors import QuantgateError
from quantgate.teams import load_teams
from tests.tiny import tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def evals(tmp_path):
    root = tmp_path / "evals"
    shutil.copytree(REPO / "evals", root)
    return root


def test_shipped_prompts_are_many_and_quote_no_eval_document(evals):
    prompts = cal.load_prompts(REPO / "recipes/calibration/prompts.yaml")
    assert len(prompts) == len(set(prompts)) >= 512  # two answers a conversation, 256 conversations
    strings = eval_strings(load_teams(evals))
    assert len(strings) > 500  # every question and message of the example sets
    cal.check_prompts(prompts, Path("prompts.yaml"), strings)  # raises on an overlap


def test_a_prompt_quoting_an_eval_document_is_refused_with_both_places(evals, tmp_path):
    doc = json.loads((evals / "support/data.jsonl").read_text().splitlines()[4])
    path = tmp_path / "prompts.yaml"
    path.write_text(f'topics: ["{doc["message"].upper()}"]\ntasks: ["Reply to: {{topic}}"]\n')
    strings = eval_strings(load_teams(evals))
    with pytest.raises(
        QuantgateError,
        match=r"prompts.yaml: the calibration prompt .* contains the eval document at "
        r".*support/data.jsonl:5; calibrating on eval data leaks the test",
    ):
        cal.check_prompts(cal.load_prompts(path), path, strings)


@pytest.mark.parametrize(
    "text, message",
    [
        ("topics: []\ntasks: ['x {topic}']\n", "topics: List should have at least 1 item"),
        ("topics: [a]\ntasks: ['no placeholder']\n", "every task must contain {topic}"),
        ("topic: [a]\ntasks: ['{topic}']\n", "topic: unknown key (the keys here: topics, tasks)"),
    ],
)
def test_bad_prompt_file_names_the_file_and_field(tmp_path, text, message):
    path = tmp_path / "prompts.yaml"
    path.write_text(text)
    with pytest.raises(QuantgateError) as err:
        cal.load_prompts(path)
    assert "prompts.yaml" in str(err.value) and message in str(err.value)
    with pytest.raises(QuantgateError, match="calibration prompt file not found"):
        cal.load_prompts(tmp_path / "missing.yaml")


def test_generate_packs_turns_into_conversations_of_min_tokens_and_leaves_out_leaks(monkeypatch):
    tok = tiny_tokenizer()
    replies = {"p0": "the capital of france is paris", "p1": "", "p2": "LEAK the capital", "p3": "a " * 40}

    def fake_answer(client, base_url, name, prompt, seed, p):
        return replies.get(prompt, "python module " * 10)

    monkeypatch.setattr(cal, "answer", fake_answer)
    prompts = ["p0", "p1", "p2", "p3"] + [f"q{i}" for i in range(20)]
    leaks = {"leak the capital": "x:1"}
    p = cal.CalibrateParams(samples=100, min_tokens=30, concurrency=2, seed=1)  # more than there are: all used
    out, left_out = cal.generate(tok, "http://x", "m", prompts, leaks, p)
    assert left_out == 2  # the empty answer and the one quoting an eval string
    assert sum(len(m) // 2 for m, _ in out) <= 22 and len(out) >= 10
    first, _ = cal.generate(tok, "http://x", "m", prompts, leaks, p.model_copy(update={"samples": 3}))
    assert first == out[:3]  # the same seeded order, stopped at `samples`
    for messages, tokens in out:
        assert tokens >= 30 and tokens == len(tok(tok.apply_chat_template(messages, tokenize=False))["input_ids"])
        assert [m["role"] for m in messages][:2] == ["user", "assistant"]
        assert all("LEAK" not in m["content"] for m in messages)
