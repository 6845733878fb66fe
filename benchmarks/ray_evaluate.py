"""evaluate@<build> on a Ray cluster on loopback with 1 and 2 replicas (issue 31), and the cost model for N nodes.

    .venv/bin/python -m benchmarks.ray_evaluate --project DIR [--build int8] [--replicas 1,2]

DIR is a project after `dvc repro evaluate@<build>` (models/<build>, evals/, params.yaml; the e2e project of
tests/conftest.py or a `make demo` one). A head and one serving node start on 127.0.0.1
(benchmarks.common.local_ray, the serving node with 2 CPUs); each run scores every team with an empty
evaluation cache. On one machine's shared cores two replicas are not faster: the figure is the overhead
(publish, probe, a second server start on the same cores).

Cost model for N serving nodes (one vLLM server each, the teams spread evenly):
    T(N) = publish + probe + start + documents / (throughput * N)
with `start` the server start and `throughput` documents per second of one server, both measured here by
the 1-replica run. Assumptions: the nodes are alike, the teams split evenly (with fewer teams than nodes a
zero-shot team's documents are split, a few-shot team's are not: quantgate/sharding.py), scoring is bound by
the server (lm-eval's client keeps it busy), and the store serves every node at once.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.common import SERVING_RESOURCE, counts_arg, local_ray, path_arg, report
from quantgate.errors import QuantgateError, run_main
from quantgate.params import BUILD_NAME


def run_once(project: Path, build: str, replicas: int, ray, work: Path) -> dict:
    """One evaluate of `build` on the cluster with `replicas` servers; its wall time and the stage's timing."""
    import os

    import pipeline.on_ray as on_ray
    import pipeline.team_scores as stage
    from pipeline.evaluate import EvaluateParams, evaluate
    from quantgate.executor import ExecutorParams
    from quantgate.params import load_block

    os.chdir(project)
    stage.CACHE_DIR = on_ray.CACHE_DIR = work / f"cache-{replicas}"  # nothing from an earlier run
    params = load_block("evaluate", EvaluateParams)
    executor = ExecutorParams(
        kind="ray",
        address=ray.address,
        resources={SERVING_RESOURCE: 1},
        replicas=replicas,
        store=f"file://{work / 'store'}",
        node_cache=str(work / "node-cache"),
    )
    out = work / f"eval-{replicas}" / build
    started = time.monotonic()
    docs = evaluate(build, project / "models" / build, project / "evals", out, params, executor)
    wall = time.monotonic() - started
    timing = json.loads((out / "timing.json").read_text())
    n = sum(t.n for d in docs.values() if d.status == "ok" for t in d.tasks.values())
    return {"wall_s": round(wall, 1), "timing": timing, "docs": n, "ok": all(d.status == "ok" for d in docs.values())}


def parse_args() -> argparse.Namespace:
    """Command-line options, checked before any Ray process starts: argparse exits 2 on bad syntax, and a
    QuantgateError names a project without the build's model, evals/ or params.yaml."""
    ap = argparse.ArgumentParser(prog="benchmarks.ray_evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--project", type=path_arg, required=True, help="a project after `dvc repro evaluate@BUILD`")
    ap.add_argument("--build", default="int8", help="the build to evaluate (default int8)")
    ap.add_argument("--replicas", type=counts_arg, default=[1, 2], help="vLLM servers per run, comma-separated (1,2)")
    ap.add_argument("--nodes", type=counts_arg, default=[1, 2, 4, 8, 16], help="N for the cost model (1,2,4,8,16)")
    a = ap.parse_args()
    if not BUILD_NAME.fullmatch(a.build):  # '' read models//config.json; ../x a folder outside models/
        raise QuantgateError(f"--build {a.build!r}: give a build of the project's params.yaml `builds`, e.g. int8")
    for need in (f"models/{a.build}/config.json", "evals", "params.yaml"):
        if not (a.project / need).exists():
            raise QuantgateError(
                f"--project {a.project}: no {need}; give a project after `dvc repro evaluate@{a.build}`"
            )
    return a


def main() -> None:
    a = parse_args()
    project = a.project.resolve()
    rows, runs = [], {}
    with tempfile.TemporaryDirectory(prefix="ray-bench-") as tmp, local_ray(Path(tmp) / "ray") as ray:
        for r in a.replicas:
            runs[r] = run = run_once(project, a.build, r, ray, Path(tmp))
            starts = [x["server_start_s"] for x in run["timing"]["replicas"]]
            rows.append(
                {
                    "scenario": f"{r} replica(s) on 1 node",
                    "wall_s": run["wall_s"],
                    "server_start_s": " / ".join(f"{s:.0f}" for s in starts),
                    "scoring_s": round(sum(run["timing"]["scoring_s"].values()), 1),
                    "docs": run["docs"],
                    "all ok": run["ok"],
                }
            )
    one = runs.get(1)
    notes = []
    if one and one["ok"]:
        start = one["timing"]["replicas"][0]["server_start_s"]
        scoring = sum(one["timing"]["scoring_s"].values())
        overhead = max(one["wall_s"] - start - scoring, 0.0)
        throughput = one["docs"] / scoring
        notes.append(
            f"cost model T(N) = {overhead:.0f} s publish+probe + {start:.0f} s start"
            f" + D / ({throughput:.2f} docs/s x N)"
        )
        for n in a.nodes:
            for docs in (one["docs"], 20 * 500):
                rows.append(
                    {
                        "scenario": f"model: {n} node(s), {docs} docs",
                        "wall_s": round(overhead + start + docs / (throughput * n), 1),
                        "server_start_s": f"{start:.0f}",
                        "scoring_s": round(docs / (throughput * n), 1),
                        "docs": docs,
                        "all ok": None,
                    }
                )
    report(
        "ray_evaluate",
        f"evaluate@{a.build} on a loopback Ray cluster",
        rows,
        meta=vars(a) | {"project": str(project)},
        notes=notes,
    )


if __name__ == "__main__":
    run_main(main)
