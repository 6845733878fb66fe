"""The executor block (quantgate/executor.py): what a Ray task asks for, and the refusals that need no cluster."""

import pytest

from quantgate.errors import QuantgateError
from quantgate.executor import ExecutorParams, connect
from quantgate.params import load_block
from quantgate.serving import free_port


def test_the_default_is_the_local_executor_and_a_task_asks_for_what_the_block_declares(tmp_path):
    assert load_block("executor", ExecutorParams) == ExecutorParams()  # params.yaml ships the defaults
    p = ExecutorParams(kind="ray", num_cpus=2, num_gpus=1, resources={"quantgate_serving": 1}, max_retries=2)
    assert p.demand() == {"CPU": 2.0, "GPU": 1.0, "quantgate_serving": 1.0}
    assert p.ray_options() == {
        "num_cpus": 2.0,
        "num_gpus": 1.0,
        "resources": {"quantgate_serving": 1.0},
        "max_retries": 2,
        "retry_exceptions": False,  # a task's own error is its answer, not a fault to retry
        "max_calls": 1,  # a fresh worker process per task: its own environment, nothing left behind
    }
    bad = tmp_path / "params.yaml"
    bad.write_text("executor:\n  kind: slurm\n  replicas: 0\n")
    with pytest.raises(QuantgateError) as err:
        load_block("executor", ExecutorParams, bad)
    assert "params.yaml:2: executor.kind: Input should be 'local' or 'ray'" in str(err.value)
    assert "params.yaml:3: executor.replicas: Input should be greater than or equal to 1" in str(err.value)


def test_no_address_or_a_head_that_does_not_answer_is_one_line_before_ray_is_started(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(QuantgateError) as err:
        connect(ExecutorParams(kind="ray"))
    assert str(err.value) == (
        "executor.kind is ray but no cluster address: set executor.address (host:port of the head) or RAY_ADDRESS"
    )
    port = free_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(QuantgateError) as err:
        connect(ExecutorParams(kind="ray", connect_timeout_s=2))
    assert str(err.value) == (
        f"executor.address 127.0.0.1:{port}: no Ray cluster answers (Connection refused); start one "
        "(`ray start --head`) or fix the address"
    )
    import ray

    assert not ray.is_initialized()
