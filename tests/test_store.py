"""Builds by content address (quantgate/store.py): published once, fetched and checked by a node, on a shared
path and on a real S3-compatible server."""

import os
import shutil

import pytest

from quantgate.errors import QuantgateError
from quantgate.manifest import config_digest, read_manifest
from quantgate.store import address, fetch, publish
from tests.conftest import safetensors_build


@pytest.fixture
def build(tmp_path):
    b = safetensors_build(tmp_path / "pipeline-machine" / "models" / "int8", "int8", seed=3, shards=2)
    (b / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    return b


def test_a_build_is_published_once_by_its_digests_and_a_node_fetches_a_checked_copy(build, tmp_path):
    store = f"file://{tmp_path / 'store'}"
    where = publish(build, store)
    assert where == address(read_manifest(build)["weights_digest"], config_digest(build))
    assert sorted(p.name for p in (tmp_path / "store" / where).iterdir()) == sorted(p.name for p in build.iterdir())
    assert (tmp_path / "store" / f"{where}.complete").is_file()
    mtime = (tmp_path / "store" / where / "build.json").stat().st_mtime_ns
    assert publish(build, store) == where and (tmp_path / "store" / where / "build.json").stat().st_mtime_ns == mtime
    shutil.rmtree(build.parents[1])  # the node never reads the pipeline machine's models/
    local = fetch(store, where, tmp_path / "node-cache")
    assert local == tmp_path / "node-cache" / where.split("/", 1)[1]
    assert (
        read_manifest(local)["build"] == "int8"
        and (local / "tokenizer_config.json").read_text() == '{"chat_template": "x"}'
    )
    assert not [p for p in (tmp_path / "node-cache").iterdir() if p.name.startswith(".fetch-")]


def test_a_damaged_or_half_published_build_is_refused_and_a_damaged_cached_copy_fetched_again(build, tmp_path):
    store = tmp_path / "store"
    where = publish(build, str(store))
    cache = tmp_path / "node-cache"
    local = fetch(str(store), where, cache)
    (local / "model-00001-of-00002.safetensors").write_bytes(b"bitrot")  # on the node's disk
    assert fetch(str(store), where, cache) == local and read_manifest(local)["weights_digest"] in where
    shutil.rmtree(cache)
    (store / where / "model-00002-of-00002.safetensors").write_bytes(b"tampered")  # in the store
    with pytest.raises(QuantgateError, match=r"model-00002-of-00002.safetensors: sha256 does not match build.json"):
        fetch(str(store), where, cache)
    assert not (cache / where.split("/", 1)[1]).exists()  # nothing half-fetched is left to be used
    (store / f"{where}.complete").unlink()  # an upload that stopped half-way
    with pytest.raises(QuantgateError, match=r"no complete build there \(its .complete marker is missing\)"):
        fetch(str(store), where, cache)


def test_the_same_weights_served_otherwise_are_another_address_and_each_node_gets_its_own_build_json(build, tmp_path):
    # int4 and int4-w4a8 (quantize.<build>.w4a8), or fp8 and fp8-kv8: one set of weights, but a node that fetched
    # int4's folder for int4-w4a8 would serve it as W4A16; a twin without settings (int4-mixed) shares int4's
    import json

    twins = {}
    for name, settings in (("int8-mixed", {}), ("int8-w4a8", {"w4a8": True}), ("int8-kv8", {"kv_cache_dtype": "fp8"})):
        twin = shutil.copytree(build, build.parent / name)
        (twin / "build.json").write_text(json.dumps(read_manifest(build) | {"build": name, **settings}))
        twins[name] = twin
    store = str(tmp_path / "store")
    where = {name: publish(d, store) for name, d in {"int8": build, **twins}.items()}
    assert where["int8-mixed"] == where["int8"]
    assert len({where["int8"], where["int8-w4a8"], where["int8-kv8"]}) == 3
    assert len({w.split("/")[1] for w in where.values()}) == 1  # one weights digest
    local = fetch(store, where["int8-w4a8"], tmp_path / "node-cache")
    assert read_manifest(local)["w4a8"] is True and "w4a8" not in read_manifest(
        fetch(store, where["int8"], tmp_path / "nc")
    )


def test_a_build_whose_weights_changed_after_it_was_made_is_not_published(build, tmp_path):
    (build / "model-00001-of-00002.safetensors").write_bytes(b"edited")
    with pytest.raises(QuantgateError, match="sha256 does not match build.json"):
        publish(build, str(tmp_path / "store"))
    assert not (tmp_path / "store").exists()


def test_an_s3_store_on_a_real_s3_compatible_server(build, tmp_path, object_store, monkeypatch):
    for k, v in object_store.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", object_store.endpoint)  # s3fs reads the endpoint from here
    store = f"s3://{object_store.bucket}/quantgate"
    where = publish(build, store)
    keys = {o["Key"] for o in object_store.client().list_objects_v2(Bucket=object_store.bucket)["Contents"]}
    assert f"quantgate/{where}.complete" in keys and f"quantgate/{where}/build.json" in keys
    local = fetch(store, where, tmp_path / "node-cache")
    assert read_manifest(local)["weights_digest"] == read_manifest(build)["weights_digest"]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(QuantgateError, match=f"executor.store {store}: cannot upload"):
        publish(safetensors_build(tmp_path / "other", "int4", seed=4, shards=1), store)
    assert os.environ["AWS_ENDPOINT_URL"] == object_store.endpoint
