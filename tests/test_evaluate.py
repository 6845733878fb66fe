"""pipeline.evaluate.run_team on a tiny model through lm-eval's in-process hf backend: the team
tasks load without lm-eval's built-in task index, and per-sample scores match lm-eval's aggregate."""
import pytest

from evals.teams import load_teams
from pipeline.evaluate import HarnessParams, run_team
from tests.tiny import tiny_llama_dir


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(tiny_llama_dir(tmp_path_factory.mktemp("tiny"))), dtype="float32", device="cpu",
                batch_size=4, max_length=128)


@pytest.mark.parametrize("team", ["search", "billing"])  # multiple choice (acc), generation (exact_match)
def test_run_team_scores_every_document_of_every_task(lm, example_evals, team, monkeypatch):
    import lm_eval.tasks

    built = []
    real = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kw: built.append(kw) or real(**kw))
    t = next(t for t in load_teams(example_evals) if t.name == team)
    doc, raw = run_team(lm, t, HarnessParams(limit=3))
    assert built == [{"include_defaults": False}]  # lm-eval's ~14,700 built-in tasks are not indexed
    [(task, summary)] = doc["tasks"].items()
    assert task == t.tasks[0].name and summary["n"] == 3 and doc["status"] == "ok"
    scores = [s["score"] for s in doc["samples"]]
    assert [s["doc_id"] for s in doc["samples"]] == [0, 1, 2] and set(scores) <= {0.0, 1.0}
    assert summary["score"] == pytest.approx(sum(scores) / 3) and doc["metric"] == t.policy.metric
    assert len(raw) >= 3 and all(r["task"] == task for r in raw)
