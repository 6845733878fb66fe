"""Where the heavy work runs: `executor.kind: local` (this machine, the default) or `ray` (issue 31).

With `ray`, evaluate@<build> runs its vLLM servers and lm-eval scoring as Ray tasks on the cluster at
`executor.address` (or RAY_ADDRESS): one task per replica, each placed by the resources the block declares
(CPUs, GPUs, and custom resources that name the nodes with a serving env, e.g. `{quantgate_serving: 1}` on
nodes started with `ray start --resources '{"quantgate_serving": 8}'`). A node runs quantgate from its own
install of the project with both of its envs (docs/at-scale.md: the image, or the KubeRay worker group).

connect() refuses, in one line and before any server starts, a cluster that does not answer and one with
no live node that has the declared resources. failure() turns what Ray raises when a task's node or worker
dies into the reason a team's scores record.
"""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import Field, field_validator

from quantgate.errors import QuantgateError
from quantgate.params import Frozen

# where nodes read builds from: object stores and shared filesystems fsspec opens without connecting (s3fs, gcsfs,
# adlfs, the local one for a shared path); not http(s) (read-only: publish cannot write there), nor ftp/sftp and
# the like, which connect when opened, so a bad one would fail inside every task rather than here
STORE_PROTOCOLS = ("s3", "gs", "gcs", "az", "abfs", "abfss", "file")


class ExecutorParams(Frozen):
    kind: Literal["local", "ray"] = "local"
    address: str | None = None  # host:port of the Ray head's GCS; None = RAY_ADDRESS
    num_cpus: float = Field(default=1.0, ge=0)  # per vLLM server task
    num_gpus: float = Field(default=0.0, ge=0)  # per vLLM server task (vLLM's tensor parallel size on GPUs)
    resources: dict[str, float] = {}  # custom resources per task, naming the nodes with a serving env
    replicas: int = Field(default=1, ge=1)  # vLLM servers, on as many tasks, that share one build's scoring
    max_retries: int = Field(default=1, ge=0)  # re-runs of a task whose node or worker died, on another node
    store: str | None = None  # URL every node reads builds from (quantgate/store.py); None = the DVC remote
    node_cache: str = "/tmp/quantgate/builds"  # where a node keeps the builds it fetched (its own disk)
    connect_timeout_s: float = Field(default=10.0, gt=0)

    @field_validator("store")
    @classmethod
    def _a_store(cls, value: str | None) -> str | None:
        """Raises ValueError for a store nodes cannot be sent to: empty, a relative path (a node would read it in
        its task's scratch folder), a URL of another protocol than STORE_PROTOCOLS, or one whose fsspec filesystem
        is not installed here (publish writes it from here)."""
        if value is None:
            return value
        protocol = value.partition("://")[0] if "://" in value else "file"
        local = protocol == "file" and not value.removeprefix("file://").startswith("/")  # a node's scratch folder
        if not value.strip() or protocol not in STORE_PROTOCOLS or local:
            raise ValueError(
                f"{value!r} is not a store: give a URL every node can read (s3://bucket/prefix, gs://, az:// or "
                "file://), an absolute shared path, or null for the project's default DVC remote"
            )
        import fsspec

        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as exc:
            raise ValueError(f"{value!r}: {exc}") from None
        return value

    @field_validator("node_cache")
    @classmethod
    def _absolute(cls, value: str) -> str:
        """Raises ValueError unless it is an absolute path: a task runs in a scratch folder removed after it, so
        a relative one ("" included) would be fetched into that folder and lost with it."""
        if not value.startswith("/"):
            raise ValueError(
                f"{value!r} is not an absolute path: a task runs in a scratch folder removed after it, so the "
                "builds would be fetched again every time; give a folder on the node's own disk, e.g. "
                "/tmp/quantgate/builds"
            )
        return value

    def demand(self) -> dict[str, float]:
        """The resources one task asks for, as Ray names them (CPU, GPU and the custom ones)."""
        return {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}

    def ray_options(self) -> dict:
        """Options of every server task: its resources, retries on node or worker death (Ray's own
        `max_retries` covers system failures only, not an error the task raises), and one task per worker
        process, so each starts with the node's own environment and leaves nothing behind."""
        return {
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            "resources": dict(self.resources),
            "max_retries": self.max_retries,
            "retry_exceptions": False,
            "max_calls": 1,
        }


def cluster_address(params: ExecutorParams) -> str:
    """executor.address, else RAY_ADDRESS; raises QuantgateError when neither is set."""
    address = params.address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise QuantgateError(
            "executor.kind is ray but no cluster address: set executor.address (host:port of the head) or RAY_ADDRESS"
        )
    return address


def _answers(address: str, timeout_s: float) -> str | None:
    """None if something accepts a TCP connection at host:port `address`, else why not."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return None
    except ValueError:
        return "not host:port"
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def asks(params: ExecutorParams) -> dict[str, float]:
    """{resource: amount} one task asks for (ExecutorParams.demand without the zero entries)."""
    return {k: v for k, v in params.demand().items() if v}


def named(need: dict[str, float]) -> str:
    """`need` as "CPU=1, serving=1" for messages."""
    return ", ".join(f"{k}={v:g}" for k, v in need.items())


def feasible(nodes: list[dict], need: dict[str, float]) -> bool:
    """Whether one of `nodes` (ray.nodes() entries) has every resource of `need` in its totals."""
    return any(all(n["Resources"].get(k, 0) >= v for k, v in need.items()) for n in nodes)


def connect(params: ExecutorParams) -> str:
    """Join the Ray cluster of `params` from this process (once) and return its address.

    Raises QuantgateError, in one line and before any work is placed, if the head does not answer, or no
    live node has the resources one task asks for (ExecutorParams.demand), naming what each node has.
    """
    import ray

    address = cluster_address(params)
    if why := _answers(address, params.connect_timeout_s):
        raise QuantgateError(
            f"executor.address {address}: no Ray cluster answers ({why}); start one (`ray start --head`) or fix "
            "the address"
        )
    if not ray.is_initialized():
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, configure_logging=False)
    need = asks(params)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if not feasible(nodes, need):
        have = "; ".join(
            f"{n['NodeManagerAddress']}:{n['NodeManagerPort']} has "
            + ", ".join(
                f"{k}={v:g}"
                for k, v in sorted(n["Resources"].items())
                if not k.startswith(("node:", "memory", "object_store"))
            )
            for n in nodes
        )
        raise QuantgateError(
            f"executor at {address}: no live node has what one task asks for ({named(need)}); "
            f"{have or 'no live node'}; fix executor.num_cpus/num_gpus/resources or start such a node"
        )
    return address


def disconnect() -> None:
    """Leave the cluster (the cluster itself keeps running)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def failure(exc: BaseException, attempts: int) -> str:
    """One line for a task that Ray gave up on after `attempts` tries: the node (IP and id) for a node
    that died, else Ray's error type and first line."""
    import ray.exceptions as rex

    first = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, rex.NodeDiedError):
        node = first.split("Node IP: ", 1)[-1].split(". This can happen")[0] if "Node IP: " in first else "unknown"
        return f"the Ray node it ran on died ({node}) after {attempts} attempt(s) (executor.max_retries)"
    if isinstance(exc, (rex.WorkerCrashedError, rex.ActorDiedError, rex.OutOfMemoryError)):
        return f"its Ray worker died ({type(exc).__name__}: {first[:200]}) after {attempts} attempt(s)"
    return f"Ray task failed ({type(exc).__name__}: {first[:200]})"
