"""The registry contract against real MLflow on three backends: an embedded sqlite store, an
`mlflow server` over sqlite with local artifacts, and an `mlflow server` over a real PostgreSQL with
artifacts in a real S3-compatible store (tests/services.py; all on loopback). Real versions come
from pipeline.register on small safetensors builds (no torch: the registry only hashes and moves
files); each test registers its own model name, so the tests share one store per backend."""

import multiprocessing
import multiprocessing.forkserver
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import mlflow.version
import pytest

from pipeline.register import RegisterParams, register
from quantgate.errors import QuantgateError
from quantgate.hashing import digest_of, sha256_file
from registry import aliases, approval, audit, lock, runs, store
from registry.status import status_lines
from registry.verify import verify_version
from tests import registry_race, services
from tests.conftest import safetensors_build
from tests.test_register import gate_result, team_summary


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on 127.0.0.1 over sqlite with local artifacts, launched at once (it starts while
    the sqlite tests run)."""
    with services.sqlite_mlflow_server(tmp_path_factory.mktemp("server")) as server:
        yield server


@pytest.fixture(scope="module")
def pg_server(request, tmp_path_factory):
    """`mlflow server` over the session's PostgreSQL with artifacts in the session's S3 store: clients
    read and write s3://quantgate/mlflow themselves (--no-serve-artifacts, the usual set-up at scale)."""
    pg, s3 = request.getfixturevalue("postgres"), request.getfixturevalue("object_store")
    root = tmp_path_factory.mktemp("pg-server")
    artifacts = ["--default-artifact-root", f"s3://{s3.bucket}/mlflow", "--no-serve-artifacts"]
    server = services.launch_mlflow_server(root, pg.uri, artifacts, s3.env())
    yield server, s3
    services.stop(server.proc)


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> Path:
    """models/{fp16,int4,fp8} (shared, never modified); int4 has two weight shards."""
    models = tmp_path_factory.mktemp("builds")
    for seed, (build, shards) in enumerate((("fp16", 1), ("int4", 2), ("fp8", 1))):
        safetensors_build(models / build, build, seed, shards)
    return models


@dataclass
class Backend:
    name: str
    uri: str
    root: Path  # working directory of the pipeline (params.yaml, dvc.lock, results/)
    artifacts: Path | None  # where a file-based store keeps artifacts (sqlite: ./mlartifacts under root)
    s3: services.ObjectStore | None = None  # the object store holding the artifacts instead
    env: dict[str, str] = field(default_factory=dict)  # what a client needs besides MLFLOW_TRACKING_URI

    def artifact_file(self, client, mv, name: str) -> Path:
        """The file in a file-based artifact store behind `model/<name>` of version `mv`."""
        uri = client.get_run(mv.run_id).info.artifact_uri
        rel = re.sub(r"^(mlflow-artifacts:|file://)", "", uri).lstrip("/")
        base = Path("/" + rel) if uri.startswith("file:") else self.artifacts / rel
        return base / "model" / name

    def overwrite_tail(self, client, mv, name: str, tail: bytes) -> None:
        """Overwrite the last bytes of the stored `model/<name>` of `mv`, in place (file or S3 object)."""
        if self.s3 is None:
            with open(self.artifact_file(client, mv, name), "r+b") as f:
                f.seek(-len(tail), 2)
                f.write(tail)
            return
        bucket, _, prefix = client.get_run(mv.run_id).info.artifact_uri.removeprefix("s3://").partition("/")
        key = f"{prefix}/model/{name}"
        body = self.s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()
        self.s3.client().put_object(Bucket=bucket, Key=key, Body=body[: -len(tail)] + tail)


@pytest.fixture(scope="module")
def forkserver():
    """A multiprocessing fork server with MLflow and registry/ imported, started early (in the
    background) so the racing processes of the concurrency test start without re-importing."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([registry_race.__name__])
    multiprocessing.forkserver.ensure_running()
    return ctx


BACKENDS = [
    "sqlite",
    "server",
    pytest.param("postgres", marks=pytest.mark.services),
]  # embedded sqlite; mlflow server on sqlite; on PostgreSQL + S3


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, mlflow_server, forkserver, tmp_path_factory) -> Backend:
    if services.postgres_bin() and any(i.nodeid.endswith("[postgres]") for i in request.session.items):
        request.getfixturevalue("pg_server")  # launched now, so it starts while the sqlite tests run
    root = tmp_path_factory.mktemp(request.param)
    (root / "params.yaml").write_text("register: {}\n")
    (root / "dvc.lock").write_text("schema: '2.0'\n")
    (root / "results/eval").mkdir(parents=True)
    if request.param == "sqlite":
        return Backend("sqlite", f"sqlite:///{root}/mlflow.db", root, root / "mlartifacts")
    if request.param == "server":
        mlflow_server.wait_ready()
        return Backend("server", mlflow_server.uri, root, mlflow_server.log.parent / "artifacts")
    server, s3 = request.getfixturevalue("pg_server")  # skips, saying why, without PostgreSQL
    server.wait_ready()
    return Backend("postgres", server.uri, root, None, s3, s3.env())


TEAMS = {"search": team_summary("5e" * 32)}


@dataclass
class Registered:
    backend: Backend
    client: object
    model: str
    out: dict

    def version(self, build: str) -> str:
        return str(self.out["builds"][build]["version"])

    def run_id(self, build: str) -> str:
        """The run of a build the register stage left unregistered (its gate did not PASS)."""
        return self.out["unregistered"][build]["run_id"]

    def override(self, build: str, by: str = "rm", reason: str = "ship it anyway") -> str:
        """Register an unregistered build by override, as `quantgate register RUN_ID --override`; its version."""
        return str(runs.register_run(self.client, self.run_id(build), by, reason).version)


@pytest.fixture
def reg(backend, builds, monkeypatch, request):
    """A function registering the tiny builds under a model name unique to the test."""
    monkeypatch.chdir(backend.root)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", backend.uri)
    for key, value in backend.env.items():
        monkeypatch.setenv(key, value)
    client = store.client()
    model = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")

    def run(verdicts: dict[str, str]) -> Registered:
        out = register(
            builds,
            gate_result(verdicts),
            "# report",
            backend.root / "results/eval",
            RegisterParams(model_name=model, experiment="builds"),
            TEAMS,
        )
        return Registered(backend, client, model, out)

    return run


def events(r: Registered, **match) -> list[audit.Event]:
    return [e for e in audit.history(r.client, r.model) if all(getattr(e, k) == v for k, v in match.items())]


def test_lineage_tags_and_fallback(reg, builds):
    r = reg({"int4": "PASS", "fp8": "FAIL"})
    mvs = {mv.tags["build"]: mv for mv in r.client.search_model_versions(f"name='{r.model}'")}
    assert set(mvs) == {"fp16", "int4"}  # the baseline and PASS builds are versions; fp8 FAILed: a run only
    fp8 = r.client.get_run(r.run_id("fp8")).data
    assert fp8.tags["gate.verdict"] == fp8.params["gate.verdict"] == "FAIL" and fp8.tags["quantgate.model"] == r.model
    lineage = {build: mv.tags for build, mv in mvs.items()} | {"fp8": fp8.tags}  # the run has the same tags
    assert all(t["gate.search.team_sha256"] == TEAMS["search"].sha256 for t in lineage.values())
    for build, t in lineage.items():
        files = {p.name: sha256_file(p) for p in (builds / build).glob("*.safetensors")}
        assert files and {k: v for k, v in t.items() if k.startswith("weights_sha256.")} == {
            f"weights_sha256.{n}": d for n, d in files.items()
        }
        assert len(files) == (2 if build == "int4" else 1) and t["weights_sha256"] == digest_of(files)
        assert (t["build"], t["scheme"], t["dtype"], t["base_model.id"], t["base_model.sha256"]) == (
            build,
            build.upper(),
            "float16",
            "tiny-llama",
            "0" * 64,
        )
        assert t["params_sha256"] == sha256_file(r.backend.root / "params.yaml")
        assert t["dvc_lock_sha256"] == sha256_file(r.backend.root / "dvc.lock")
        assert (t["version.torch"], t["version.mlflow"]) == (metadata.version("torch"), mlflow.version.VERSION)
        assert t["git_commit"]
    assert mvs["fp16"].tags["gate.verdict"] == "BASELINE" and mvs["int4"].tags["gate.verdict"] == "PASS"
    base = r.version("fp16")
    assert str(mvs["fp16"].version) == base and aliases.current(r.client, r.model) == {"fallback": base}
    # set_fallback is audited once; setting it again changes nothing and writes nothing
    assert aliases.set_fallback(r.client, r.model, base, by="ci", reason="again") == []
    [e] = events(r, alias="fallback")
    assert (e.action, e.from_version, e.to_version) == ("set_fallback", None, base)
    with pytest.raises(QuantgateError, match=rf"v{r.version('int4')} is not the baseline build \(gate.verdict=PASS\)"):
        aliases.set_fallback(r.client, r.model, r.version("int4"), by="ci", reason="wrong")
    assert all(not m.name.endswith(".quantgate-lock") for m in r.client.search_registered_models())


def test_approval_refused_for_fail_then_override_recorded(reg):
    r = reg({"int4": "PASS", "fp8": "FAIL"})
    v = r.override("fp8")  # registering it by override is not approving it
    with pytest.raises(
        QuantgateError, match=rf"{r.model} v{v}: gate.verdict is FAIL, not PASS; approving it needs --override"
    ):
        approval.approve(r.client, r.model, v, "alice", "ship it")
    assert "approval" not in r.client.get_model_version(r.model, v).tags and events(r, action="approve") == []
    a = approval.approve(r.client, r.model, v, "alice", "ship it", override_reason="search team accepts the drop")
    assert a.approved and a.override and a.by == "alice"
    t = r.client.get_model_version(r.model, v).tags
    assert (t["approval"], t["approval.by"], t["approval.reason"], t["approval.override_reason"]) == (
        "approved",
        "alice",
        "ship it",
        "search team accepts the drop",
    )
    assert datetime.fromisoformat(t["approval.at"]).tzinfo is not None
    [e] = events(r, action="approve")
    assert (e.version, e.by, e.reason, e.override_reason) == (v, "alice", "ship it", "search team accepts the drop")
    # the same command again (a retry) records nothing; another reason is a new approval
    again = approval.approve(r.client, r.model, v, "alice", "ship it", override_reason="search team accepts the drop")
    assert again.unchanged and again.at == a.at and len(events(r, action="approve")) == 1
    assert not approval.approve(
        r.client, r.model, v, "alice", "ship it, canary clean", override_reason="search team accepts the drop"
    ).unchanged
    assert len(events(r, action="approve")) == 2
    assert any(f"v{v} " in line and "approved:alice(override)" in line for line in status_lines(r.client, r.model))
    # revoke: not approved any more, audited, promotion refused
    assert approval.revoke(r.client, r.model, v, "bob", "bad outputs").state == "revoked"
    assert "approval.override_reason" not in r.client.get_model_version(r.model, v).tags
    assert [e.action for e in events(r, version=v)] == ["register", "approve", "approve", "revoke"]
    with pytest.raises(QuantgateError, match=rf"v{v} is not approved for serving: revoked by bob"):
        aliases.promote(r.client, r.model, v, None, "alice", "go")


def test_recommendation_override_is_recorded_audited_and_shown(reg):
    r = reg({"int4": "PASS", "fp8": "FAIL"})
    v = r.version("int4")
    assert approval.read_recommendation(r.client.get_model_version(r.model, v).tags)[0] == "-"  # not priced here
    with pytest.raises(QuantgateError, match="--recommend must not be empty"):
        approval.override_recommendation(r.client, r.model, v, "alice", " ")
    cell, line = approval.override_recommendation(r.client, r.model, v, "alice", "the GPU fleet runs it natively")
    assert cell == "override" and line.startswith("recommended by alice's override: the GPU fleet runs it natively")
    t = r.client.get_model_version(r.model, v).tags
    assert (t["recommendation.override_by"], t["recommendation.override_reason"]) == (
        "alice",
        "the GPU fleet runs it natively",
    )
    [e] = events(r, action="recommend")
    assert (e.version, e.by, e.reason) == (v, "alice", "the GPU fleet runs it natively")
    assert "approval" not in t  # a recommendation approves nothing
    assert any(f"v{v} " in ln and "reco=override" in ln for ln in status_lines(r.client, r.model))


def test_a_build_that_did_not_pass_is_registered_only_by_override(reg, tmp_path):
    r = reg({"int4": "PASS", "fp8": "FAIL"})
    run_id = r.run_id("fp8")
    assert r.client.search_model_versions(f"run_id='{run_id}'") == []
    lines = status_lines(r.client, r.model)
    assert "quantgate register RUN_ID --override REASON" in lines[-2]
    no_buys = f"{'-':<29}"  # what-it-buys column: this registry's runs were not profiled
    assert re.fullmatch(rf"  -    fp8    FP8          gate=FAIL         {no_buys} run {run_id} search=FAIL", lines[-1])
    with pytest.raises(
        QuantgateError,
        match=rf"run {run_id} \(build fp8 of {r.model}\): gate.verdict is FAIL, not PASS, so it was not registered; "
        rf"to ship it anyway: quantgate register {run_id} --override REASON",
    ):
        runs.register_run(r.client, run_id, "alice", None)
    with pytest.raises(QuantgateError, match="run 'nope' does not exist in this registry"):
        runs.register_run(r.client, "nope", "alice", "x")
    audit_run = audit.begin(r.client, r.model, action="approve", by="x", reason="x", at=audit.utc_now(), op="o")
    with pytest.raises(QuantgateError, match=f"run {audit_run} is not a quantgate build run"):
        runs.register_run(r.client, audit_run, "alice", "x")
    with pytest.raises(QuantgateError, match=rf"run {r.out['builds']['int4']['run_id']} \(build int4\) is already "):
        runs.register_run(r.client, r.out["builds"]["int4"]["run_id"], "alice", "x")
    assert len(r.client.search_model_versions(f"name='{r.model}'")) == 2 and events(r, action="register") == []
    mv = runs.register_run(r.client, run_id, "alice", "billing signed off on the drop")
    t = mv.tags
    assert (mv.run_id, t["build"], t["gate.verdict"], t["registration.by"]) == (run_id, "fp8", "FAIL", "alice")
    assert t["registration.override_reason"] == "billing signed off on the drop" and "mlflow.user" not in t
    assert t["weights_sha256"] == r.client.get_run(run_id).data.tags["weights_sha256"]
    assert verify_version(r.client, r.model, mv.version, tmp_path / "v").is_dir()
    [e] = events(r, action="register")
    assert (e.version, e.by, e.override_reason) == (str(mv.version), "alice", "billing signed off on the drop")
    assert f"register v{mv.version} by alice" in e.line()
    with pytest.raises(QuantgateError, match=rf"is already registered as {r.model} v{mv.version}"):
        runs.register_run(r.client, run_id, "alice", "again")
    lines = status_lines(r.client, r.model)
    assert not any(" run " in line for line in lines)  # listed with the versions now
    assert "        registered by alice overriding the gate: billing signed off on the drop" in lines
    # approving it still needs its own override
    with pytest.raises(QuantgateError, match="gate.verdict is FAIL, not PASS; approving it needs --override"):
        approval.approve(r.client, r.model, mv.version, "alice", "ship it")
    # dvc repro again with the same evidence: the registered build's version is reused, nothing left unregistered
    again = reg({"int4": "PASS", "fp8": "FAIL"})
    assert again.out["builds"]["fp8"] == {
        "version": str(mv.version),
        "run_id": run_id,
        "verdict": "FAIL",
        "reused": True,
    }
    assert again.out["unregistered"] == {} and len(r.client.search_model_versions(f"name='{r.model}'")) == 3


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_register_by_override_verifies_the_run_weights_first(reg, builds):
    r = reg({"int4": "FAIL"})
    stored = r.backend.artifact_file(r.client, SimpleNamespace(run_id=r.run_id("int4")), SHARD2)
    stored.write_bytes(stored.read_bytes()[:-8] + b"\x00" * 8)
    with pytest.raises(QuantgateError, match=rf"run {r.run_id('int4')}: model/{SHARD2} .*refusing to register it"):
        r.override("int4")
    assert len(r.client.search_model_versions(f"name='{r.model}'")) == 1 and events(r, action="register") == []


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)  # store-independent beyond what other tests cover
def test_ui_approval_of_fail_version_without_override_reads_not_approved(reg):
    r = reg({"int4": "PASS", "fp8": "FAIL"})
    v = r.override("fp8")
    for key, value in {"approval": "approved", "approval.by": "carol", "approval.reason": "looks fine"}.items():
        r.client.set_model_version_tag(r.model, v, key, value)  # what a release manager does in the UI
    a = approval.approval_of(r.client, r.model, v)
    assert not a.approved and a.state == "invalid"
    assert "gate.verdict=FAIL and no approval.override_reason" in a.why
    with pytest.raises(
        QuantgateError, match="not approved for serving: not approved: approval=approved by carol but gate.verdict=FAIL"
    ):
        aliases.promote(r.client, r.model, v, None, "carol", "go", verify=False)
    assert any("NOT-APPROVED" in line for line in status_lines(r.client, r.model))
    # the same in the UI on a PASS build counts, once who and why are filled in
    p = r.version("int4")
    r.client.set_model_version_tag(r.model, p, "approval", "Approved")  # a near-miss value does not count
    assert (
        "tag approval='Approved' is neither 'approved' nor 'revoked'" in approval.approval_of(r.client, r.model, p).why
    )
    r.client.set_model_version_tag(r.model, p, "approval", "approved")
    assert "approval.by and approval.reason are empty" in approval.approval_of(r.client, r.model, p).why
    r.client.set_model_version_tag(r.model, p, "approval.by", "carol")
    r.client.set_model_version_tag(r.model, p, "approval.reason", "canary clean")
    assert approval.approval_of(r.client, r.model, p).approved


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_gate_verdict_tag_edited_in_the_ui_does_not_count(reg):
    from registry import versions

    r = reg({"int4": "PASS", "fp8": "FAIL"})
    v = r.override("fp8")
    mv = r.client.get_model_version(r.model, v)
    assert versions.recorded_verdict(r.client, mv) == "FAIL"  # the run's param, written at registration
    r.client.set_model_version_tag(r.model, v, "gate.verdict", "PASS")  # someone "fixes" the verdict in the UI
    for key, value in {"approval": "approved", "approval.by": "carol", "approval.reason": "looks fine"}.items():
        r.client.set_model_version_tag(r.model, v, key, value)
    a = approval.approval_of(r.client, r.model, v)
    assert not a.approved and a.state == "invalid"
    assert "tag gate.verdict is 'PASS' but the build's run recorded 'FAIL' at registration" in a.why
    with pytest.raises(QuantgateError, match="set it back to FAIL"):
        approval.approve(r.client, r.model, v, "carol", "go", override_reason="accepted risk")
    with pytest.raises(QuantgateError, match="not approved for serving"):
        aliases.promote(r.client, r.model, v, None, "carol", "go", verify=False)
    assert any("recorded 'FAIL'" in line for line in status_lines(r.client, r.model))
    with pytest.raises(QuantgateError, match="is not the baseline build"):  # nor can the tag make it the fallback
        r.client.set_model_version_tag(r.model, v, "gate.verdict", "BASELINE")
        aliases.set_fallback(r.client, r.model, v, "carol", "edited")
    u = r.version("int4")  # nobody approved it: status still says the tag is not the recorded verdict
    r.client.delete_model_version_tag(r.model, u, "gate.verdict")
    assert any(
        "tag gate.verdict is missing but the build's run recorded 'PASS'" in line
        for line in status_lines(r.client, r.model)
    )
    r.client.set_model_version_tag(r.model, v, "gate.verdict", "FAIL")  # set back: the override path works again
    assert approval.approve(r.client, r.model, v, "carol", "go", override_reason="accepted risk").override


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_register_back_fills_and_never_changes_the_recorded_verdict(reg):
    from registry import versions

    r = reg({"int4": "PASS", "fp8": "FAIL"})
    exp = r.client.get_experiment_by_name("builds").experiment_id
    legacy = r.client.create_run(exp).info.run_id  # a run registered before the verdict was recorded
    versions.record_verdict(r.client, legacy, "PASS")
    versions.record_verdict(r.client, legacy, "PASS")  # the same again: nothing to do
    assert r.client.get_run(legacy).data.params == {"gate.verdict": "PASS"}
    with pytest.raises(QuantgateError, match="recorded gate.verdict=PASS but the gate now says FAIL"):
        versions.record_verdict(r.client, legacy, "FAIL")
    # a version registered before the param existed has only its tag, read as before
    tags = {"gate.verdict": "PASS", "approval": "approved", "approval.by": "a", "approval.reason": "r"}
    assert approval.read_approval(tags, None).approved and not approval.read_approval(tags, "FAIL").approved
    again = reg({"int4": "PASS", "fp8": "FAIL"})  # dvc repro again: versions and runs reused, verdicts unchanged
    assert again.out["unregistered"]["fp8"]["reused"] and again.run_id("fp8") == r.run_id("fp8")
    assert again.out["builds"]["int4"]["reused"] and again.version("int4") == r.version("int4")


def test_concurrent_promotions_from_two_processes_one_wins(reg, forkserver):
    r = reg({"int4": "PASS", "fp8": "PASS"})
    a, b = r.version("int4"), r.version("fp8")
    for v in (a, b):
        approval.approve(r.client, r.model, v, "rm", "gate PASS")
    barrier, queue = forkserver.Barrier(2), forkserver.Queue()
    procs = [
        forkserver.Process(
            target=registry_race.promote_at_barrier,
            args=(r.backend.uri, r.backend.env, r.model, v, barrier, queue),
        )
        for v in (a, b)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    won = [x for x in results if "won" in x]
    lost = [x for x in results if "conflict" in x]
    assert len(won) == 1 and len(lost) == 1, results
    winner = won[0]["version"]
    assert won[0]["won"] == [f"production: none -> v{winner}", f"previous: none -> v{r.version('fp16')}"]
    assert re.search(
        rf"production is v{winner}, not none as expected; someone else changed it first.*nothing was changed",
        lost[0]["conflict"],
    )
    assert aliases.current(r.client, r.model)[aliases.PRODUCTION] == winner
    assert [(e.by, e.to_version) for e in events(r, alias="production")] == [(f"proc-{winner}", winner)]
    assert aliases.current(r.client, r.model)[aliases.PREVIOUS] == r.version("fp16")  # the serving fallback
    assert all(not m.name.endswith(".quantgate-lock") for m in r.client.search_registered_models())


def test_promote_rollback_and_history_point_in_time(reg):
    r = reg({"int4": "PASS", "fp8": "PASS"})
    base, a, b = r.version("fp16"), r.version("int4"), r.version("fp8")
    for v in (a, b):
        approval.approve(r.client, r.model, v, "rm", "gate PASS")
    with pytest.raises(
        QuantgateError, match=rf"v{base} is not approved for serving: not approved \(no `approval` tag\)"
    ):
        aliases.promote(r.client, r.model, base, None, "rm", "no", verify=False)
    exp = store.experiment_id(
        r.client, aliases.CANARY_EXPERIMENT, r.client.tracking_uri
    )  # a canary run as canary/controller.py makes it
    canary = r.client.create_run(exp, tags={"model": r.model, "candidate_version": a}).info.run_id
    r.client.set_tag(canary, "canary.phase", "initializing")
    aliases.set_candidate(r.client, r.model, a, "canary-bot", "canary start", canary_run_id=canary, verify=False)
    r.client.set_tag(canary, "canary.phase", "promoting")
    assert [
        str(c) for c in aliases.promote(r.client, r.model, a, None, "rm", "canary clean", canary_run_id=canary)
    ] == [f"production: none -> v{a}", f"previous: none -> v{base}", f"candidate: v{a} -> none"]  # fallback served
    with pytest.raises(aliases.AliasConflict, match=rf"production is v{a}, not none as expected"):
        aliases.promote(r.client, r.model, b, None, "rm", "stale view", verify=False)
    aliases.promote(r.client, r.model, b, a, "rm", "next", verify=False)
    assert aliases.current(r.client, r.model) == {"fallback": base, "production": b, "previous": a}
    # rollback restores previous and clears it: a second rollback cannot flip back to the bad build
    assert [str(c) for c in aliases.rollback(r.client, r.model, "oncall", "p99 latency", verify=False)] == [
        f"production: v{b} -> v{a}",
        f"previous: v{a} -> none",
    ]
    assert aliases.current(r.client, r.model) == {"fallback": base, "production": a}
    with pytest.raises(QuantgateError, match="has no 'previous' alias: nothing to roll back to; `--to fallback`"):
        aliases.rollback(r.client, r.model, "oncall", "again", verify=False)
    aliases.rollback(r.client, r.model, "oncall", "still bad", to="fallback")
    assert aliases.current(r.client, r.model) == {"fallback": base, "production": base}
    # the audit trail answers "what was production at time T"
    prod = events(r, alias="production")
    assert [(e.action, e.from_version, e.to_version) for e in prod] == [
        ("promote", None, a),
        ("promote", a, b),
        ("rollback", b, a),
        ("rollback", a, base),
    ]
    assert prod[0].canary_run_id == canary and prod[0].by == "rm" and prod[2].reason == "p99 latency"
    # done_at: when the change was written (the audit run ended), after it was asked for and before the next
    assert all(e.at <= e.done_at <= later.at and 0 <= e.took_s < 60 for e, later in zip(prod, prod[1:], strict=False))
    ms = timedelta(milliseconds=1)
    assert aliases.alias_at(r.client, r.model, "production", prod[0].at - ms) is None
    assert aliases.alias_at(r.client, r.model, "production", prod[0].at) == a
    assert aliases.alias_at(r.client, r.model, "production", prod[1].at) == b
    assert aliases.alias_at(r.client, r.model, "production", prod[2].at - ms) == b
    assert aliases.alias_at(r.client, r.model, "previous", prod[1].at) == a
    assert aliases.alias_at(r.client, r.model, "previous", prod[2].at) is None
    assert aliases.alias_at(r.client, r.model, "candidate", prod[0].at - ms) == a
    assert aliases.alias_at(r.client, r.model, "production", prod[3].at.replace(tzinfo=None)) == base
    lines = status_lines(r.client, r.model)
    assert any(f"v{base} " in line and "[fallback,production]" in line for line in lines)
    assert any(f"v{a} " in line and "approved:rm" in line for line in lines)


def _promote_refused(r: Registered, v: str, match: str) -> None:
    with pytest.raises(QuantgateError, match=match):
        aliases.promote(r.client, r.model, v, None, "rm", "go")
    assert aliases.PRODUCTION not in aliases.current(r.client, r.model)


def test_tampered_weights_refused_for_serving(reg, tmp_path):
    r = reg({"int4": "PASS"})
    v = r.version("int4")
    approval.approve(r.client, r.model, v, "rm", "gate PASS")
    mv = r.client.get_model_version(r.model, v)
    if r.backend.s3 is not None:  # the weights are objects in the S3 store, read by the client itself
        uri = r.client.get_run(mv.run_id).info.artifact_uri
        assert uri.startswith(f"s3://{r.backend.s3.bucket}/mlflow/")
        listed = r.backend.s3.client().list_objects_v2(Bucket=r.backend.s3.bucket, Prefix=uri[5:].partition("/")[2])
        assert {o["Key"].rsplit("/", 1)[1] for o in listed["Contents"]} >= {SHARD1, SHARD2}
    local = verify_version(r.client, r.model, v, tmp_path / "ok")
    assert {p.name: sha256_file(p) for p in local.glob("*.safetensors")} == {
        k.removeprefix("weights_sha256."): d for k, d in mv.tags.items() if k.startswith("weights_sha256.")
    }
    r.backend.overwrite_tail(r.client, mv, SHARD2, b"\x01" * 8)
    with pytest.raises(
        QuantgateError,
        match=rf"{r.model} v{v}: model/{SHARD2} in the artifact store has sha256 .* "
        rf"but tag weights_sha256.{SHARD2} says .*refusing to serve it",
    ):
        verify_version(r.client, r.model, v, tmp_path / "bad")
    _promote_refused(r, v, f"model/{SHARD2} in the artifact store has sha256")
    with pytest.raises(QuantgateError, match="not empty"):
        verify_version(r.client, r.model, v, tmp_path / "bad")


SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)  # store-independent beyond what other tests cover
def test_missing_and_extra_weight_files_refused(reg, tmp_path):
    r = reg({"int4": "PASS"})
    v = r.version("int4")
    stored = r.backend.artifact_file(r.client, r.client.get_model_version(r.model, v), SHARD1)
    extra = stored.with_name("extra.safetensors")
    extra.write_bytes(b"not registered")
    with pytest.raises(
        QuantgateError, match="weight files in the artifact store that were not registered: model/extra.safetensors"
    ):
        verify_version(r.client, r.model, v, tmp_path / "a")
    extra.unlink()
    stored.unlink()
    with pytest.raises(QuantgateError, match=f"model/{SHARD1} is missing from the artifact store"):
        verify_version(r.client, r.model, v, tmp_path / "b")
    # the tags are checked against each other too: an edited per-file tag is caught
    r.client.set_model_version_tag(r.model, v, f"weights_sha256.{SHARD2}", "0" * 64)
    with pytest.raises(QuantgateError, match="tags do not add up to tag weights_sha256"):
        verify_version(r.client, r.model, v, tmp_path / "c")


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)  # store-independent beyond what other tests cover
def test_a_build_json_that_no_longer_sets_what_was_gated_is_refused_for_serving(reg, tmp_path):
    # every server reads w4a8 / kv_cache_dtype from the downloaded build.json: edited or lost after the gate,
    # a W4A8 build would be served as W4A16 (or the reverse)
    import json

    r = reg({"int4": "PASS"})
    v = r.version("int4")
    stored = r.backend.artifact_file(r.client, r.client.get_model_version(r.model, v), "build.json")
    manifest = json.loads(stored.read_text())
    assert "w4a8" not in manifest and verify_version(r.client, r.model, v, tmp_path / "ok").is_dir()
    stored.write_text(json.dumps(manifest | {"w4a8": True}))
    with pytest.raises(
        QuantgateError,
        match=rf"{r.model} v{v}: model/build.json sets \{{'w4a8': 'true'\}} but the tags recorded none when it was "
        "gated, so it would be served otherwise than it was gated; refusing to serve it",
    ):
        verify_version(r.client, r.model, v, tmp_path / "a")
    # the defaults written out, or a KV cache dtype from before that tag was written: served as before
    for setting in ({"w4a8": False, "kv_cache_dtype": "auto"}, {"kv_cache_dtype": "fp8"}):
        stored.write_text(json.dumps(manifest | setting))
        assert verify_version(r.client, r.model, v, tmp_path / f"ok-{len(setting)}").is_dir()
    r.client.set_model_version_tag(r.model, v, "kv_cache_dtype", "fp8")  # a tagged one must still be set
    stored.write_text(json.dumps(manifest))
    with pytest.raises(QuantgateError, match=r"sets no serving setting but the tags recorded \{'kv_cache_dtype'"):
        verify_version(r.client, r.model, v, tmp_path / "kv")
    r.client.delete_model_version_tag(r.model, v, "kv_cache_dtype")
    r.client.set_model_version_tag(r.model, v, "w4a8", "true")  # gated as W4A8; its build.json lost the setting
    with pytest.raises(QuantgateError, match=r"sets no serving setting but the tags recorded \{'w4a8': 'true'\}"):
        verify_version(r.client, r.model, v, tmp_path / "b")
    for broken in ("{broken", "[1, 2]"):
        stored.write_text(broken)
        with pytest.raises(QuantgateError, match=r"model/build.json is unreadable or not a JSON object; refusing"):
            verify_version(r.client, r.model, v, tmp_path / f"c{len(broken)}")


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)  # store-independent beyond what other tests cover
def test_alias_to_missing_or_deleted_version_refused(reg):
    r = reg({"int4": "PASS", "fp8": "PASS"})
    a, b = r.version("int4"), r.version("fp8")
    with pytest.raises(QuantgateError, match=rf"{r.model} v99 does not exist \(never registered, or deleted\)"):
        aliases.set_candidate(r.client, r.model, "v99", "rm", "typo")
    approval.approve(r.client, r.model, b, "rm", "gate PASS")
    r.client.delete_model_version(r.model, b)
    with pytest.raises(QuantgateError, match=rf"v{b} does not exist"):
        aliases.promote(r.client, r.model, b, None, "rm", "go")
    with pytest.raises(QuantgateError, match=rf"v{b} does not exist"):
        aliases.set_fallback(r.client, r.model, b, "rm", "go")
    with pytest.raises(QuantgateError, match="'three' is not a model version number"):
        aliases.promote(r.client, r.model, "three", None, "rm", "go")
    with pytest.raises(QuantgateError, match=rf"v{b} does not exist"):
        approval.approve(r.client, r.model, b, "rm", "again")
    assert set(aliases.current(r.client, r.model)) == {"fallback"} and events(r, action="promote") == []
    assert a not in aliases.current(r.client, r.model).values()


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.services)], indirect=True)
def test_lock_busy_names_holder_and_stale_lock_is_broken(reg):
    r = reg({})
    first = lock.acquire(r.client, r.model, "promote v2 by alice")
    assert any(line.startswith("  lock: held by promote v2 by alice") for line in status_lines(r.client, r.model))
    with pytest.raises(QuantgateError, match=r"is quantgate's registry lock, not a model"):
        status_lines(r.client, lock.lock_name(r.model))
    with pytest.raises(lock.LockBusy, match=r"holds the registry lock: promote v2 by alice \(pid \d+ on .*retry later"):
        lock.acquire(r.client, r.model, "bob", wait_s=0.3)
    second = lock.acquire(r.client, r.model, "carol", stale_after_s=-1)  # judged stale: broken, then taken
    with pytest.raises(QuantgateError, match="lost the registry lock"):
        first.check()
    first.release()  # not ours any more: left alone
    assert lock.holder_of(r.client, r.model)["lock.holder"] == "carol"
    second.release()
    assert lock.holder_of(r.client, r.model) is None
    assert [m.name for m in r.client.search_registered_models() if r.model in m.name] == [r.model]


@pytest.mark.parametrize(
    "name, message",
    [
        ("latest", "reserved by MLflow"),
        ("v3", "reserved by MLflow"),
        ("V12", "reserved by MLflow"),
        ("prod", "unknown alias 'prod'"),
        ("Production", "unknown alias"),
    ],
)
def test_reserved_and_unknown_alias_names_refused(name, message):
    with pytest.raises(QuantgateError, match=message):
        aliases.check_alias(name)
    with pytest.raises(QuantgateError, match=message):
        aliases.alias_at(None, "m", name, audit.utc_now())  # refused before the registry is read
    for ok in ("production", "previous", "candidate", "fallback"):
        assert aliases.check_alias(ok) == ok


def test_rollback_target_must_be_previous_or_fallback():
    with pytest.raises(QuantgateError, match="rollback goes to 'previous' or 'fallback', not 'candidate'"):
        aliases.rollback(None, "m", "rm", "x", to="candidate")


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)  # store-independent beyond what other tests cover
def test_commands_print_errors_without_traceback(reg):
    from click.testing import CliRunner

    from registry.commands import COMMANDS, approve, history, promote, register, revoke, rollback

    assert [c.name for c in COMMANDS] == ["register", "approve", "revoke", "promote", "rollback", "history"]
    r = reg({"int4": "PASS", "fp8": "FAIL"})
    runner = CliRunner()
    for args, message in (
        ([r.run_id("fp8")], "gate.verdict is FAIL, not PASS, so it was not registered; to ship it anyway: quantgate"),
        (["0" * 32, "--override", "x"], f"run '{'0' * 32}' does not exist in this registry"),
    ):
        res = runner.invoke(register, [*args, "--by", "alice"])
        assert res.exit_code == 1 and message in res.output and len(res.output.splitlines()) == 1
    res = runner.invoke(register, [r.run_id("fp8"), "--by", "alice", "--override", "billing accepts the drop"])
    assert res.exit_code == 0 and f"registered build fp8 from run {r.run_id('fp8')}, gate.verdict=FAIL" in res.output
    bad, good = re.search(rf"{r.model} v(\d+): registered", res.output).group(1), r.version("int4")
    assert f"next: quantgate approve {r.model} {bad} --reason ... --override REASON" in res.output
    res = runner.invoke(approve, [r.model, bad, "--by", "alice", "--reason", "x"])
    assert res.exit_code == 1 and "Error: " in res.output and "needs --override REASON" in res.output
    assert "Traceback" not in res.output and res.exception.__class__ is SystemExit
    res = runner.invoke(approve, [r.model, f"v{good}", "--reason", "gate PASS"], env={"USER": "dora"})
    assert res.exit_code == 0 and "approved by dora" in res.output
    res = runner.invoke(approve, [r.model, good, "--by", "dora", "--reason", "gate PASS"])
    assert res.exit_code == 0 and "already approved by dora" in res.output and "nothing recorded" in res.output
    res = runner.invoke(promote, [r.model, good, "--expect-production", good, "--by", "dora", "--reason", "go"])
    assert res.exit_code == 1 and "production is none, not v" in res.output
    res = runner.invoke(promote, [r.model, good, "--expect-production", "none", "--by", "dora", "--reason", "go"])
    assert res.exit_code == 0 and f"production: none -> v{good}" in res.output
    res = runner.invoke(revoke, [r.model, good, "--by", "erin", "--reason", "bad outputs"])
    assert res.exit_code == 0 and "revoked by erin" in res.output
    assert f"warning: v{good} is still 'production'; run `quantgate rollback {r.model}" in res.output
    base = r.version("fp16")  # the first promotion made the serving fallback `previous`
    res = runner.invoke(rollback, [r.model, "--by", "oncall", "--reason", "bad"])
    assert res.exit_code == 0 and f"production: v{good} -> v{base}" in res.output
    res = runner.invoke(rollback, [r.model, "--by", "oncall", "--reason", "again"])
    assert res.exit_code == 1 and "has no 'previous' alias: nothing to roll back to" in res.output
    res = runner.invoke(history, [r.model])
    assert res.exit_code == 0 and "promote production none -> v" in res.output and "approve v" in res.output
    res = runner.invoke(history, [r.model, "--at", "2000-01-01T00:00:00Z"])
    assert res.exit_code == 0 and "production=none" in res.output
    for naive in ("2000-01-01T00:00:00", "2000-01-01"):  # no zone = UTC, as --help says (was a TypeError)
        res = runner.invoke(history, [r.model, "--at", naive])
        assert res.exit_code == 0 and "production=none" in res.output, res.output
    res = runner.invoke(history, [r.model, "--at", "yesterday"])
    assert res.exit_code == 2 and "is not an ISO time" in res.output
    res = runner.invoke(history, ["no-such-model"])  # a typo: the error says where it looked
    assert res.exit_code == 1 and res.output.splitlines() == [
        f"Error: model 'no-such-model' is not registered at {r.backend.uri}; check the name "
        "(params.yaml register.model_name) or MLFLOW_TRACKING_URI"
    ]


def test_commands_outside_a_project_do_not_create_an_empty_registry(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from cli.main import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for args in (["history", "m"], ["status", "m"], ["approve", "m", "1", "--by", "a", "--reason", "r"]):
        res = CliRunner().invoke(cli, args)
        assert (
            res.exit_code == 1 and f"no registry at {tmp_path / 'mlflow.db'}: run from the project folder" in res.output
        )
    res = CliRunner().invoke(cli, ["status"])  # no MODEL and no params.yaml to take the default from
    assert (
        res.exit_code == 1
        and f"no params.yaml in {tmp_path}: run from the project folder, or name the model" in res.output
    )
    assert list(tmp_path.iterdir()) == []
    dead = f"http://127.0.0.1:{services.free_port()}"  # nothing listens: one line in seconds, not minutes of retries
    res = CliRunner().invoke(cli, ["history", "m"], env={"MLFLOW_TRACKING_URI": dead})
    assert res.exit_code == 1 and f"MLflow server at {dead} is not reachable (ConnectError)" in res.output


@pytest.mark.parametrize("given, shown", [("v1", "v1"), ("1", "v1")])
def test_version_argument_accepts_v_prefix(given, shown, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from registry.commands import approve

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/m.db")
    result = CliRunner().invoke(approve, ["m", given, "--by", "ann", "--reason", "r"])
    # no such model: the error names the version as MLflow numbers it, never "vv1"
    assert result.exit_code == 1 and "vv1" not in result.output and "Traceback" not in result.output


def test_version_argument_rejects_non_numbers():
    from click.testing import CliRunner

    from registry.commands import promote

    result = CliRunner().invoke(promote, ["m", "latest", "--expect-production", "none", "--reason", "r", "--by", "a"])
    assert result.exit_code == 2 and "'latest' is not a model version; give its number, e.g. 3 or v3" in result.output
    result = CliRunner().invoke(promote, ["m", "2", "--expect-production", "garbage", "--reason", "r", "--by", "a"])
    assert result.exit_code == 2 and "e.g. 3 or v3 or none" in result.output
    for args in (["m", "v0", "--expect-production", "none"], ["m", "2", "--expect-production", "000"]):
        result = CliRunner().invoke(promote, [*args, "--reason", "r", "--by", "a"])  # went to the registry, exit 1
        assert result.exit_code == 2 and "MLflow numbers model versions from 1; give its number, e.g. 3 or v3" in (
            result.output
        ), result.output


@pytest.mark.parametrize("command", ["register", "approve", "revoke", "promote", "rollback", "canary run"])
def test_an_empty_by_is_refused_in_one_line_before_the_registry(command, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from cli.main import cli

    args = {
        "register": ["0" * 32, "--override", "x"],
        "approve": ["m", "1", "--reason", "r"],
        "revoke": ["m", "1", "--reason", "r"],
        "promote": ["m", "1", "--expect-production", "none", "--reason", "r"],
        "rollback": ["m", "--reason", "r"],
        "canary run": ["m", "1"],
    }[command]
    monkeypatch.chdir(tmp_path)  # no registry here: a refusal that reached it would say so instead
    for by, env, why in (
        (["--by", ""], {"USER": "dora"}, "it is empty"),
        (["--by", "  "], {"USER": "dora"}, "it is empty"),
        ([], {"USER": ""}, "its default, $USER (else $MLFLOW_TRACKING_USERNAME), is unset or empty here"),
    ):
        result = CliRunner().invoke(cli, [*command.split(), *args, *by], env=env)
        assert result.exit_code == 2 and result.output.splitlines()[-1] == (  # a usage error, as every bad argument
            f"Error: Invalid value for '--by': {why}; name who is acting (it is recorded), e.g. --by alice"
        ), result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.services
def test_unreachable_database_or_object_store_and_wrong_credentials_are_one_line_in_seconds(pg_server, postgres):
    from click.testing import CliRunner

    from cli.main import cli

    server, s3 = pg_server
    server.wait_ready()
    dead = services.free_port()  # nothing listens there
    at_server = {**s3.env(), "MLFLOW_TRACKING_URI": server.uri}
    for env, message in (
        (
            {"MLFLOW_TRACKING_URI": f"postgresql://quantgate:secret@127.0.0.1:{dead}/mlflow"},
            f"database at postgresql://quantgate:***@127.0.0.1:{dead}/mlflow is not reachable (connection failed: ",
        ),
        (
            {"MLFLOW_TRACKING_URI": postgres.uri.replace("/mlflow", "/nope")},
            'is not reachable (connection failed: connection to server at "127.0.0.1", port '
            f'{postgres.port} failed: FATAL: database "nope" does not exist); start it or fix MLFLOW_TRACKING_URI',
        ),
        (
            at_server | {"MLFLOW_S3_ENDPOINT_URL": f"http://127.0.0.1:{dead}"},
            f"object store at http://127.0.0.1:{dead} is not reachable (EndpointConnectionError); start it or fix",
        ),
        (
            at_server | {"AWS_SECRET_ACCESS_KEY": "wrong"},
            f"the object store at {s3.endpoint} refused the credentials (SignatureDoesNotMatch); fix AWS_ACCESS_KEY_ID",
        ),
        (at_server | {"AWS_ACCESS_KEY_ID": "AKIA" + "X" * 16}, "refused the credentials (InvalidAccessKeyId)"),
    ):
        started = time.monotonic()
        res = CliRunner().invoke(cli, ["history", "m"], env=env)
        took = time.monotonic() - started
        assert res.exit_code == 1 and message in res.output and len(res.output.splitlines()) == 1, res.output
        assert took < 10, f"{took:.1f} s for: {res.output}"
    # the same server with the right key, and the database itself as the tracking URI, answer
    for env in (at_server, {"MLFLOW_TRACKING_URI": postgres.uri}):
        res = CliRunner().invoke(cli, ["history", "no-such-model"], env=env)
        assert res.output.startswith("Error: model 'no-such-model' is not registered at "), res.output
        assert len(res.output.splitlines()) == 1, res.output
