"""Running a stage's heavy part as Ray tasks (issue 31): the pieces evaluate and profile share.

Driver side: `submit` places a task by the executor block's resources, `settle` waits for tasks and turns
each into (reply, None) or (None, one-line reason), including the case Ray cannot: a task to re-run after its
node died when no live node can take it. Node side: `on_node` gives a task its node's identity, a scratch
folder as working directory (never the pipeline machine's project), the build fetched from the store and
checked, and a relative serving python taken from the node's own install of the project.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from quantgate import store
from quantgate.credentials import drop_credentials
from quantgate.errors import QuantgateError
from quantgate.executor import ExecutorParams, asks, failure, feasible, named
from quantgate.scratch import scratch_dir

PROJECT = Path(__file__).resolve().parents[1]  # the project install on a node (the image's checkout)


def node_python(python: str) -> str:
    """A serving python as a node runs it: a relative path is the node's own project install's."""
    return python if Path(python).is_absolute() else str(PROJECT / python)


def node_identity() -> dict:
    """{node_id, ip (the address the node joined the cluster with), host} of the Ray node running the caller."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), None)
    return {"node_id": node_id, "ip": ip or ray.util.get_node_ip_address(), "host": socket.gethostname()}


@contextmanager
def on_node(request: dict) -> Iterator[tuple[dict, Path, Path]]:
    """Inside a task: (node identity, the build fetched from request["store"] at request["where"] into
    request["node_cache"], a scratch folder that is the working directory and is removed after). The
    scratch folder holds request["files"] ({relative path: content}); registry and cloud credentials are
    dropped from the environment once the build is fetched (quantgate/credentials.py): a task renders team
    templates.

    Raises QuantgateError naming the node (IP and id) for anything that fails inside the block.
    """
    node = node_identity()
    work = scratch_dir("quantgate-task-")  # one a SIGKILLed task left is swept by the next
    os.chdir(work)  # never the pipeline machine's project folder: nothing here is read from it
    try:
        model_dir = store.fetch(request["store"], request["where"], Path(request["node_cache"]))
        drop_credentials(os.environ)  # after the fetch, before lm-eval renders any team's templates
        for rel, data in request.get("files", {}).items():  # what the task reads besides the build
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            (work / rel).write_bytes(data)
        yield node, model_dir, work
    except QuantgateError as exc:
        raise QuantgateError(f"Ray node {node['ip']} ({node['node_id'][:12]}): {exc}") from None
    finally:
        os.chdir(tempfile.gettempdir())
        shutil.rmtree(work, ignore_errors=True)


def submit(fn: Callable[[dict], dict], request: dict, executor: ExecutorParams):
    """Place `fn(request)` as a Ray task with the executor's resources and retries; return its ref."""
    import ray

    return ray.remote(**executor.ray_options())(fn).remote(request)  # max_calls is not an .options() key


def settle(refs: list, executor: ExecutorParams, poll_s: float = 2.0) -> list[tuple[dict | None, str | None]]:
    """(reply, None) or (None, one-line reason) for each task of `refs`, in order, once all are settled.

    A task that raised gives its own first line. Ray re-runs a task whose node died (executor.max_retries),
    but a re-run that no live node can take would wait for ever: when no live node has the resources one task
    asks for any more, the tasks still waiting are cancelled and their reason names the nodes that died.
    """
    import ray
    import ray.exceptions as rex

    started = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
    need = asks(executor)
    waiting, done = list(refs), {}
    while waiting:
        ready, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=poll_s)
        for ref in ready:
            try:
                done[ref] = (ray.get(ref), None)
            except rex.RayTaskError as exc:  # the task raised: its own one-line reason
                done[ref] = (None, raised(exc))
            except rex.RayError as exc:
                done[ref] = (None, failure(exc, executor.max_retries + 1))
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if waiting and not feasible(alive, need):
            gone = [n for i, n in started.items() if i not in {a["NodeID"] for a in alive}]
            dead = ", ".join(f"{n['NodeManagerAddress']} ({n['NodeID'][:12]})" for n in gone) or "none"
            for ref in waiting:
                ray.cancel(ref, force=True)
                why = f"the Ray node it ran on died ({dead}) and no live node has {named(need)} to run it again"
                done[ref] = (None, why)
            waiting = []
    return [done[ref] for ref in refs]


def folder_files(folder: Path, under: str) -> dict[str, bytes]:
    """{`under`/relative path: content} of every file in `folder` (a team's eval set: validated, bounded)."""
    return {
        f"{under}/{p.relative_to(folder).as_posix()}": p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def raised(exc) -> str:
    """One line for an error a task raised (a ray.exceptions.RayTaskError): a QuantgateError's own message
    (it names the node), else the error's type and first line, and the node's address."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip()
    first = text.splitlines()[0] if text else ""
    if isinstance(cause, QuantgateError):
        return first
    return f"{type(cause).__name__}: {first[:300]} (in a Ray task on {getattr(exc, 'ip', None) or 'a node'})"


def published(model_dir: Path, executor: ExecutorParams) -> dict:
    """The part of every task's request that names the build: {store, where, node_cache}, after publishing
    the build in `model_dir` to the executor's store (or the project's DVC remote)."""
    url = executor.store or store.default_store()
    return {"store": url, "where": store.publish(model_dir, url), "node_cache": executor.node_cache}
