"""The recorded calibration set (quantgate/recorded.py) and the calibrate stage that reads it (no server): one
commit, one calibration set; a record made otherwise is refused with the file and the remedy."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

import pipeline.calibrate as cal
from quantgate.errors import QuantgateError
from quantgate.params import load_block
from quantgate.recorded import read_record, record_files, write_record
from tests.tiny import tiny_llama_dir

REPO = Path(__file__).resolve().parents[1]
WORDS = "the python module reads a file and writes a table of results for the team " * 3


@pytest.fixture
def setup(tmp_path):
    evals = tmp_path / "evals"
    shutil.copytree(REPO / "evals", evals)
    for shipped in evals.glob("*/calibration.jsonl"):  # the recorded set alone, unless a test adds a team's
        shipped.unlink()
    model = tiny_llama_dir(tmp_path / "fp16")
    prompts = tmp_path / "prompts.yaml"
    prompts.write_text("topics: [files, tables]\ntasks: ['Explain {topic}.', 'Summarise {topic}.']\n")
    p = cal.CalibrateParams(prompts=str(prompts), samples=3, min_tokens=20, recorded=str(tmp_path / "rec" / "recorded"))
    conversations = [
        [{"role": "user", "content": f"Explain topic {i}."}, {"role": "assistant", "content": f"{i}: {WORDS}"}]
        for i in range(4)
    ]
    with_ = cal.made_with(p, cal.load_prompts(prompts))
    write_record(Path(p.recorded), conversations, with_, cal.model_identity(model), {"machine": "AVX2-only"})
    return evals, model, p


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_stage_twice_writes_the_same_set_from_the_record(setup, tmp_path):
    evals, model, p = setup
    assert cal.calibrate(model, evals, tmp_path / "a.jsonl", p) == 3
    assert cal.calibrate(model, evals, tmp_path / "b.jsonl", p) == 3
    assert sha(tmp_path / "a.jsonl") == sha(tmp_path / "b.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    data, meta = record_files(Path(p.recorded))
    assert [r["source"] for r in rows] == [f"{data}:1", f"{data}:2", f"{data}:3"]
    assert rows[0]["text"].startswith("user: Explain topic 0.\nassistant: 0: the python") and rows[0]["tokens"] >= 20
    described = json.loads(meta.read_text())
    assert described["conversations"] == 4 and described["sha256"] == sha(data) and described["machine"] == "AVX2-only"
    assert described["made_with"]["min_tokens"] == 20 and described["made_with"]["temperature"] == 0.7


def test_a_teams_own_conversations_come_first_and_a_recorded_answer_quoting_a_document_is_left_out(setup, tmp_path):
    evals, model, p = setup
    doc = json.loads((evals / "support/data.jsonl").read_text().splitlines()[0])["message"]
    data, _ = record_files(Path(p.recorded))
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[1]["messages"][1]["content"] += " " + doc  # an answer that now quotes a team's document
    cal_json = Path(p.recorded).with_suffix(".json")
    write_record(
        Path(p.recorded),
        [r["messages"] for r in rows],
        json.loads(cal_json.read_text())["made_with"],
        cal.model_identity(model),
        {},
    )
    own = {"messages": [{"role": "user", "content": "my own question"}, {"role": "assistant", "content": "mine"}]}
    (evals / "billing" / "calibration.jsonl").write_text(json.dumps(own) + "\n")
    assert cal.calibrate(model, evals, tmp_path / "out.jsonl", p) == 3
    sources = [json.loads(line)["source"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sources == [f"{evals}/billing/calibration.jsonl:1", f"{data}:1", f"{data}:3"]
    with pytest.raises(QuantgateError) as err:
        cal.calibrate(model, evals, tmp_path / "out.jsonl", p.model_copy(update={"samples": 5}))
    assert str(err.value) == (
        f"calibrate: only 4 conversations (teams' own and 4 recorded in {p.recorded}.jsonl), calibrate.samples asks "
        "5; record more with `make calibration`, or lower calibrate.samples"
    )


def test_a_record_made_otherwise_is_refused_naming_the_file_and_what_differs(setup, tmp_path):
    evals, model, p = setup
    data, meta = record_files(Path(p.recorded))
    out = tmp_path / "out.jsonl"
    with pytest.raises(QuantgateError) as err:
        cal.calibrate(model, evals, out, p.model_copy(update={"temperature": 0.8, "seed": 1}))
    assert str(err.value) == (
        f"{meta}: recorded with other calibrate settings (seed 0 vs 1 now, temperature 0.7 vs 0.8 now); restore them "
        "or make one with `make calibration` (the 16-bit build answers the prompts: minutes)"
    )
    other = tiny_llama_dir(tmp_path / "other", seed=5)
    with pytest.raises(QuantgateError, match=r"recorded.json: recorded from another 16-bit build \(weights_digest"):
        cal.calibrate(other, evals, out, p)
    data.write_text(data.read_text().replace("topic 2", "topic 9"))
    with pytest.raises(QuantgateError, match=r"recorded.jsonl: changed since it was recorded .*git checkout"):
        cal.calibrate(model, evals, out, p)
    meta.unlink()
    with pytest.raises(
        QuantgateError, match=r"recorded.json: no recorded calibration set \(calibrate.recorded\); make"
    ):
        cal.calibrate(model, evals, out, p)
    assert not out.exists()


def test_the_shipped_record_matches_the_shipped_prompts_and_settings():
    p = load_block("calibrate", cal.CalibrateParams, REPO / "params.yaml")
    stem = REPO / p.recorded
    with_ = cal.made_with(p, cal.load_prompts(REPO / p.prompts))
    described = json.loads(stem.with_suffix(".json").read_text())
    assert described["made_with"] == with_ and described["conversations"] >= p.samples
    rows = read_record(stem, with_, described["model"])
    assert len(rows) == described["conversations"] and all(len(m) >= 2 for _, m in rows)
    # every quantize block that calibrates asks for no more than the stage writes
    import yaml

    quantize = yaml.safe_load((REPO / "params.yaml").read_text())["quantize"]
    asked = [q["calibration"]["samples"] for q in quantize.values() if q.get("calibration")]
    assert asked and max(asked) <= p.samples


def test_a_recorded_message_of_another_shape_is_refused_at_its_line(setup, tmp_path):
    evals, model, p = setup
    data, meta = record_files(Path(p.recorded))
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[2]["messages"][1] = {"role": "bot", "content": 1}
    described = json.loads(meta.read_text())
    write_record(Path(p.recorded), [r["messages"] for r in rows], described["made_with"], described["model"], {})
    with pytest.raises(QuantgateError, match=rf'{data}:3: expected {{"messages": \[{{"role": "user"'):
        cal.calibrate(model, evals, tmp_path / "out.jsonl", p)
