"""Shared fixtures: example team folders and scores documents written in the test."""
import json
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def example_evals(tmp_path) -> Path:
    """A copy of the repo's example eval sets, safe to break."""
    dst = tmp_path / "evals"
    shutil.copytree(REPO / "evals", dst, ignore=shutil.ignore_patterns("*.py", "__pycache__", "README.md"))
    return dst


def write_scores(root: Path, build: str, team: str, scores: list[float], *, status="ok", task="t", hashes=None, **extra):
    """Write results/eval/<build>/<team>/scores.json as the evaluate stage does."""
    d = root / build / team
    d.mkdir(parents=True, exist_ok=True)
    doc = {"team": team, "build": build, "status": status, **extra}
    if status == "ok":
        doc["samples"] = [{"task": task, "doc_id": i, "doc_hash": (hashes or {}).get(i, f"h{i}"), "score": s}
                          for i, s in enumerate(scores)]
    (d / "scores.json").write_text(json.dumps(doc))
    return d
