"""DVC remote storage on an S3-compatible object store (the session's, tests/services.py): a small
DVC project with a build stage (safetensors weights) and a results stage is reproduced, `dvc push`ed
to s3://quantgate/dvc, cloned afresh with git, `dvc pull`ed, and `dvc repro` there has nothing to do.
Real DVC with dvc-s3; the full pipeline's stages take minutes each, the remote protocol is the same."""

import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.common import commit, project_env
from tests.conftest import REPO

DVC = str(REPO / ".venv" / "bin" / "dvc")

DVC_YAML = """\
stages:
  build:
    cmd: python build.py models/tiny
    deps: [build.py]
    outs: [models/tiny]
  score:
    cmd: python score.py models/tiny results/score.json
    deps: [score.py, models/tiny]
    metrics:
      - results/score.json:
          cache: true
"""
BUILD_PY = """\
import sys
from pathlib import Path
import numpy as np
from safetensors.numpy import save_file
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
w = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float16)
save_file({"layers.0.weight": w}, str(out / "model.safetensors"))
(out / "config.json").write_text('{"model_type": "llama"}')
"""
SCORE_PY = """\
import hashlib, json, sys
from pathlib import Path
weights = Path(sys.argv[1], "model.safetensors").read_bytes()
Path(sys.argv[2]).parent.mkdir(parents=True, exist_ok=True)
Path(sys.argv[2]).write_text(json.dumps({"sha256": hashlib.sha256(weights).hexdigest(), "bytes": len(weights)}))
"""


def dvc(args: list[str], cwd: Path, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    """Run `dvc ARGS` in `cwd`; with check, fail the test with DVC's output when it fails."""
    p = subprocess.run([DVC, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if check and p.returncode != 0:
        pytest.fail(f"dvc {' '.join(args)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


@pytest.mark.services
def test_push_then_a_fresh_clone_pulls_and_is_up_to_date(object_store, tmp_path):
    env = project_env() | object_store.env()  # the key comes from the environment, never from .dvc/config
    project = tmp_path / "project"
    project.mkdir()
    for name, text in {"dvc.yaml": DVC_YAML, "build.py": BUILD_PY, "score.py": SCORE_PY}.items():
        (project / name).write_text(text)
    commit(project, "tiny project")
    dvc(["init", "-q"], project, env)
    dvc(["config", "core.analytics", "false"], project, env)
    dvc(["remote", "add", "-d", "store", f"s3://{object_store.bucket}/dvc"], project, env)
    dvc(["remote", "modify", "store", "endpointurl", object_store.endpoint], project, env)
    dvc(["repro", "-q"], project, env)
    commit(project, "reproduced")  # dvc.yaml, dvc.lock and .dvc/config, as a team would push them

    started = time.monotonic()
    pushed = dvc(["push"], project, env)
    push_s = time.monotonic() - started
    assert "4 files pushed" in pushed.stdout  # two weights files, the folder listing (.dir), results/score.json
    keys = [
        o["Key"] for o in object_store.client().list_objects_v2(Bucket=object_store.bucket, Prefix="dvc/")["Contents"]
    ]
    assert len(keys) == 4 and all(k.startswith("dvc/files/md5/") for k in keys)  # 3 files + the folder listing

    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(project), str(clone)], check=True)
    assert not (clone / "models" / "tiny").exists() and not (clone / "results" / "score.json").exists()
    # a wrong secret: the store refuses it (403), nothing is written
    bad = dvc(["pull"], clone, env | {"AWS_SECRET_ACCESS_KEY": "wrong"}, check=False)
    assert (
        bad.returncode != 0
        and "Forbidden" in bad.stderr
        and not (clone / "models" / "tiny" / "model.safetensors").exists()
    )
    started = time.monotonic()
    pulled = dvc(["pull"], clone, env)
    pull_s = time.monotonic() - started
    assert "4 files fetched and 3 files added" in pulled.stdout
    for rel in ("models/tiny/model.safetensors", "models/tiny/config.json", "results/score.json"):
        assert (clone / rel).read_bytes() == (project / rel).read_bytes()
    assert "Data and pipelines are up to date." in dvc(["status"], clone, env).stdout
    assert "Data and pipelines are up to date." in dvc(["repro"], clone, env).stdout
    print(f"\ndvc push {push_s:.1f} s, dvc pull {pull_s:.1f} s (moto S3 on loopback)")
