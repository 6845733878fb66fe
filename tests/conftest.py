"""Shared fixtures: example team folders, scores documents written in the test, tiny safetensors
builds a real registry accepts (`safetensors_build`), and the end-to-end project (one real
`dvc repro`) shared by tests/test_e2e.py and tests/test_fleet_e2e.py."""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from benchmarks.common import project_env, scratch_project
from pipeline.evaluate import EvaluateParams
from quantgate.errors import QuantgateError
from quantgate.params import load_block
from quantgate.precision import precision_record, probe, slowdown_problem, w4a16_problem, w8a8_problem

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def example_evals(tmp_path) -> Path:
    """A copy of the repo's example eval sets, safe to break."""
    dst = tmp_path / "evals"
    shutil.copytree(REPO / "evals", dst, ignore=shutil.ignore_patterns("README.md"))
    return dst


def checkout_view(dst: Path) -> Path:
    """A folder at `dst` whose entries link to this checkout's, but for what stages write (results/, models/,
    .quantgate/, .dvc/, mlflow.db): a stage run there (`python -m pipeline.validate`, cwd=dst) reads the project's
    params.yaml, recipes and eval sets and writes its log under dst/results/logs, not into the checkout."""
    dst.mkdir()
    for item in REPO.iterdir():
        if item.name not in {"results", "models", ".quantgate", ".dvc", "mlflow.db", ".git"}:
            (dst / item.name).symlink_to(item)
    return dst


def write_scores(
    root: Path, build: str, team: str, scores: list[float], *, status="ok", task="t", hashes=None, **extra
):
    """Write results/eval/<build>/<team>/scores.json as the evaluate stage does."""
    d = root / build / team
    d.mkdir(parents=True, exist_ok=True)
    doc = {"team": team, "build": build, "status": status, **extra}
    if status == "ok":
        doc["samples"] = [
            {"task": task, "doc_id": i, "doc_hash": (hashes or {}).get(i, f"h{i}"), "score": s}
            for i, s in enumerate(scores)
        ]
    (d / "scores.json").write_text(json.dumps(doc))
    if not (root / build / "precision.json").exists():  # the evaluate stage writes one per build
        (root / build / "precision.json").write_text(
            json.dumps({"dtype": "float32", "requested": "auto", "why": "auto: test"})
        )
    return d


def pytest_configure(config):
    """SIGTERM (a CI timeout, `kill`) becomes KeyboardInterrupt, so pytest still runs fixture
    teardown and stops the vLLM servers the e2e fixtures started instead of orphaning them."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def pytest_collection_modifyitems(config, items):
    """Stop in one line, before any test runs, when tests that make real builds and projects are selected
    and the disk cannot hold them: a full disk errors every later test in its fixture instead."""
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its controller checked (pytest_sessionstart)
        return
    if any(item.get_closest_marker("e2e") or item.get_closest_marker("services") for item in items):
        check_disk()


def pytest_sessionstart(session):
    """Under pytest-xdist (`-n N`) the controller collects nothing and a worker's pytest.exit reads as a crash
    (xdist restarts it, ten times): the controller checks the disk before any worker starts, for the tests the
    -m expression can select."""
    config = session.config
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return
    from _pytest.mark.expression import Expression  # pytest's own -m parser (private module, there since 6.0)

    if not config.option.markexpr:
        return check_disk()
    try:
        expression = Expression.compile(config.option.markexpr)
    except SyntaxError as exc:  # pytest's own words; under xdist the workers would each fail on it, in a traceback
        pytest.exit(f"Wrong expression passed to '-m': {config.option.markexpr}: {exc}", returncode=4)
    if any(expression.evaluate(only(marker)) for marker in ("e2e", "services")):
        check_disk()


def only(marker: str):
    """A -m matcher (pytest's ExpressionMatcher: the name positional, keyword arguments free) true for `marker`."""

    def matches(name: str, /, **kwargs) -> bool:
        return name == marker

    return matches


def check_disk() -> None:
    """pytest.exit (status 2) naming each place with less than QUANTGATE_TEST_MIN_FREE_GIB (default MIN_FREE_GIB)
    free, and what to do; nothing when both have it."""
    need = float(os.environ.get("QUANTGATE_TEST_MIN_FREE_GIB", MIN_FREE_GIB))
    short = [f"{where} has {free / 2**30:.1f} GiB free" for where, free in disk_free() if free < need * 2**30]
    if short:
        pytest.exit(
            f"the end-to-end and service tests need about {need:g} GiB free on disk ({'; '.join(short)}); free some "
            "space (old clones, /tmp), run only the tests that build nothing (`pytest tests -m 'not e2e and not "
            "services'`), or set QUANTGATE_TEST_MIN_FREE_GIB",
            returncode=2,
        )


# Free disk the e2e and service tests need beside the two envs: the e2e project's builds and runs (2.3-2.9 GiB
# seen in pytest's tmp dir), the serving tests' projects (0.3-0.7 GiB each, removed as each passes) and headroom.
MIN_FREE_GIB = 6


def disk_free() -> list[tuple[str, int]]:
    """Free bytes where the tests write: the temp dir (pytest's tmp_path, the e2e project) and the checkout."""
    places = {os.stat(where).st_dev: where for where in (str(REPO), tempfile.gettempdir())}  # one per filesystem
    return [(where, shutil.disk_usage(where).free) for where in places.values()]


LIMIT = 12  # docs per task: real numbers through every stage, small enough for CI
# calibration scaled down for CI: the first 8 conversations of the recorded set (calibrate.recorded)
CALIBRATION = {"samples": 8}
SMALL_CALIBRATION = {"samples": 8, "seq_len": 128, "pipeline": "sequential"}
SEARCH = {"looks": [LIMIT], "doc_budget": 6 * LIMIT * 4, "kl_samples": 2, "kl_seq_len": 64}  # scaled down
PROFILE = {"concurrency": [1, 2], "output_len": 8}  # the profile stages, scaled down (most of it is the server start)


def e2e_serve() -> dict:
    """params.yaml's evaluate.serve for the e2e project: int8 is served even where its kernel is inexact (oneDNN
    without VNNI, quantgate.precision.wrong_int8_problem): the e2e tests need a served candidate on every CPU kind
    to exercise the canary, the gateway, Ray and a server's death, and the gate then judges it as served. The
    refusal itself is tests/test_probe.py's and tests/test_serving.py's."""
    return {**load_params_doc()["evaluate"]["serve"], "inexact_int8": True}


SERVE_PYTHON = str(REPO / ".venv-serve" / "bin" / "python")


# The default model's architecture (SmolLM2-135M-Instruct) as an FP8_DYNAMIC build's config.json has it
SMOLLM2_FP8_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}},
    },
}


def run_precision() -> dict:
    """The precision the e2e run gets on this machine (params.yaml's evaluate.serve.dtype through
    the one rule, quantgate.precision), with "w4a16_problem": why W4A16 cannot be served at it
    here, "int8_problem": why the int8 W8A8 build cannot, and "fp8_problem": why the fp8 build is too
    slow to score here (evaluate.serve.max_slowdown, the probe's timing of vLLM's FP8 path), each or None.
    The probe is the only source: the tests expect what it says, never a guess."""
    serve = load_block("evaluate", EvaluateParams, REPO / "params.yaml").serve
    requested = serve.dtype
    try:
        record = precision_record(SERVE_PYTHON, requested)
        platform = probe(SERVE_PYTHON)
        problem = w4a16_problem(platform, record["dtype"], requested)
        int8 = w8a8_problem(platform, record["dtype"], inexact_ok=True)  # as the e2e project serves (SERVE)
    except QuantgateError as exc:  # no serving env: the e2e tests then fail on their own
        return {"dtype": None, "w4a16_problem": str(exc), "int8_problem": str(exc), "fp8_problem": str(exc)}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(SMOLLM2_FP8_CONFIG))
            fp8 = slowdown_problem(SERVE_PYTHON, platform, Path(tmp), record["dtype"], serve.max_slowdown)
    except QuantgateError as exc:  # the timing itself failed: the stages fail fp8 closed with this reason, whose
        # interpreter path and command differ there (a relative path, the project's folder): its middle is kept
        fp8 = (
            "cannot time this build's emulated forward: "
            + str(exc).split(" emulated forward: ")[-1].split("; run `")[0]
        )
    return {**record, "w4a16_problem": problem, "int8_problem": int8, "fp8_problem": fp8}


def w4a16_servable() -> bool:
    """Whether the serving env's vLLM serves W4A16 here at the run's precision (run_precision)."""
    return run_precision()["w4a16_problem"] is None


# e2e helpers (used by tests/test_e2e.py and tests/test_fleet_e2e.py)
def run(cmd, cwd, check=True, timeout=3600):
    p = subprocess.run(
        cmd, cwd=cwd, env=project_env(), capture_output=True, text=True, timeout=timeout, shell=isinstance(cmd, str)
    )
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def load_params_doc() -> dict:
    """params.yaml as a plain mapping."""
    import yaml

    return yaml.safe_load((REPO / "params.yaml").read_text())


@pytest.fixture(scope="session")
def project(tmp_path_factory):
    """A fresh git copy of the working tree with the two envs linked in, after one `dvc repro`.

    QUANTGATE_E2E_PROJECT=DIR reuses such a directory from an earlier run (development only:
    iterate on the fleet tests without re-running the pipeline).
    """
    if os.environ.get("QUANTGATE_E2E_PROJECT"):
        return Path(os.environ["QUANTGATE_E2E_PROJECT"])
    quantize = load_params_doc()["quantize"]
    small = {b: {**q, "calibration": SMALL_CALIBRATION} if "calibration" in q else q for b, q in quantize.items()}
    root = scratch_project(
        tmp_path_factory.mktemp("e2e") / "quantgate",
        limit=LIMIT,
        params={
            "calibrate": CALIBRATION,
            "quantize": small,
            "search": SEARCH,
            "profile": PROFILE,
            "evaluate": {"serve": e2e_serve()},
        },
    )
    started = time.monotonic()
    out = run(["dvc", "repro"], root)
    print(f"\ne2e: dvc repro took {time.monotonic() - started:.0f} s")
    (root / "repro.log").write_text(out.stdout + out.stderr)
    return root


LOCAL = {"models", ".dvc", ".quantgate", "mlflow.db", "mlartifacts"}  # not copied by light_copy
PROFILE_CACHE = ".quantgate/cache/profile"  # but for this one


def light_copy(project: Path, dst: Path, drop_eval: str | None = None, link_each_model: bool = False) -> Path:
    """`project` (an e2e project) at `dst` without its DVC cache, eval cache and registry (its profile cache
    copied), its models linked:
    models/ itself, or with `link_each_model` a folder of links, one per build (a stage may then write a new
    build there, not in the shared project); results/eval/<drop_eval> removed when given."""
    dst.mkdir()
    for item in project.iterdir():
        if item.name == "models" and link_each_model:
            (dst / "models").mkdir()
            for build in item.iterdir():
                (dst / "models" / build.name).symlink_to(build.resolve())
        elif item.name == "models":
            (dst / item.name).symlink_to(item)
        elif item.name in LOCAL:
            continue
        elif item.is_symlink():
            (dst / item.name).symlink_to(os.readlink(item))
        elif item.is_dir():
            shutil.copytree(item, dst / item.name, symlinks=True)
        else:
            shutil.copy2(item, dst / item.name)
    if (profiles := project / PROFILE_CACHE).is_dir():  # measurements by content: a stage's server measures no
        shutil.copytree(profiles, dst / PROFILE_CACHE)  # build the project measured (pipeline/measuring.py)
    if drop_eval:
        shutil.rmtree(dst / "results/eval" / drop_eval)
    return dst


@contextmanager
def registered_in_copy(work: Path, build: str):
    """Run the register stage's function in `work` (a light_copy) for `build` and the baseline, into a registry of
    the copy's own (sqlite in work/mlflow.db); yields (register's result, an MLflow client of that registry)."""
    from _pytest.monkeypatch import MonkeyPatch

    from pipeline.register import RegisterParams, register
    from quantgate.results import read_gate, read_teams
    from registry import store

    with MonkeyPatch.context() as mp:
        mp.chdir(work)
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{work / 'mlflow.db'}")
        result = read_gate(work / "results/gate.json")
        registered = register(
            work / "models",
            result.model_copy(update={"builds": {build: result.builds[build]}}),
            (work / "results/gate_report.md").read_text(),
            work / "results/eval",
            load_block("register", RegisterParams, work / "params.yaml"),
            read_teams(work / "results/teams.json"),
        )
        yield registered, store.client()


def approved_version(client, model: str, build: str, entry: dict, n_docs: int) -> str:
    """The model version of `build` (its results/registry.json `entry`) in an e2e project's registry,
    approved: a build whose gate did not PASS on the CI-sized sets (`n_docs` documents) is a run
    only, so it is registered and approved here by a recorded override."""
    from registry import approval, runs

    why = f"test: {build} did not PASS on {n_docs}-doc sets (CI limit)"
    if "version" in entry:
        version = str(entry["version"])
    else:
        mv = runs.registered_as(client, entry["run_id"]) or runs.register_run(client, entry["run_id"], "e2e-test", why)
        version = str(mv.version)
    if not approval.approval_of(client, model, version).approved:
        approval.approve(client, model, version, "e2e-test", "end-to-end test", override_reason=why)
    return version


def safetensors_build(path: Path, build: str, seed: int, shards: int) -> Path:
    """A build directory as the quantize stage leaves it, without torch: `shards` real
    safetensors weight files (small random tensors), a config and build.json."""
    import numpy as np
    from safetensors.numpy import save_file

    from quantgate.manifest import write_manifest

    path.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for i in range(shards):
        name = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({f"layers.{i}.weight": rng.standard_normal((64, 64)).astype(np.float16)}, str(path / name))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    write_manifest(
        path,
        build=build,
        scheme=build.upper(),
        dtype="float16",
        base_model={"id": "tiny-llama", "sha256": "0" * 64},
        recipe={"source": "test"},
    )
    return path


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL on 127.0.0.1 for the whole session (tests/services.py); skipped, saying
    why, on a machine without PostgreSQL's server binaries."""
    from tests import services

    if services.postgres_bin() is None:
        pytest.skip("no PostgreSQL server binaries (initdb, postgres): apt-get install postgresql")
    pg = services.start_postgres()
    yield pg
    services.stop(pg.proc, signal.SIGINT)  # PostgreSQL's fast shutdown
    shutil.rmtree(pg.data, ignore_errors=True)


@pytest.fixture(scope="session")
def object_store(tmp_path_factory):
    """A real S3-compatible server (moto, IAM authentication on) on 127.0.0.1 for the whole session,
    with bucket `quantgate` and one access key (tests/services.py)."""
    from tests import services

    store = services.start_object_store(tmp_path_factory.mktemp("s3"))
    yield store
    services.stop(store.proc)
