"""Did the search's cost estimate hold? The candidate of one screen of a finished search, made and profiled.

The search prices each candidate before it exists (pipeline/search.py, Pricing): its seconds per output token
interpolated by weight share between the 16-bit build's and the base build's measured throughput, as a multiple
of the 16-bit build's. This makes
that candidate with quantize (the search's base recipe with the screen's layers in `ignore`, calibrated as
quantize.<search.build>), profiles it as the profile stage does, and prints the estimate beside the
measurement, in $ per 1M output tokens at cost.gpu_hour_usd (the gate's figure) and as a multiple of fp16's.

Run in a project after `dvc repro` (its folder the cwd: params.yaml, results/search/search.json,
results/profile/fp16.json, models/fp16, results/calibration.jsonl):
    .venv/bin/python -m benchmarks.search_estimate [--kept K] [--work DIR]
K: the layers kept 16-bit of the screen to check (default: the search's last screen).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common import path_arg, report, rounded
from pipeline.profile import ProfileParams, measured
from pipeline.quantize import QuantizeParams, quantize
from pipeline.search import SearchParams, mixed_recipe
from quantgate.cost import CostParams, usd_per_million_tokens
from quantgate.errors import QuantgateError, run_main
from quantgate.params import BASELINE_BUILD, load_block
from quantgate.results import read_profile, read_search
from quantgate.serving import ServeParams


def usd(profile, price: float) -> tuple[float, float]:
    """(output tokens/s at the largest profiled concurrency, $ per 1M output tokens) of a profiled build.
    Raises QuantgateError for one without a measured load."""
    top = profile.top_load() if profile.status == "profiled" else None
    if top is None or top.output_tokens_per_s <= 0:
        raise QuantgateError(f"{profile.build}: no measured throughput ({profile.reason or 'no load'})")
    return top.output_tokens_per_s, usd_per_million_tokens(price, top.output_tokens_per_s)


def main() -> None:
    ap = argparse.ArgumentParser(prog="benchmarks.search_estimate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kept", type=int, default=None, help="layers kept 16-bit of the screen to check")
    ap.add_argument("--work", type=path_arg, default=Path(".bench/search_estimate"), help="where the build goes")
    args = ap.parse_args()
    p = load_block("search", SearchParams)
    r = read_search(Path("results/search/search.json"))
    if not r.screens:
        raise QuantgateError("results/search/search.json has no screen: run `dvc repro` with the search first")
    kept_n = r.screens[-1].kept if args.kept is None else args.kept
    screen = next((s for s in r.screens if s.kept == kept_n), None)
    if screen is None:
        raise QuantgateError(f"--kept {kept_n}: no screen kept that many (screened: {[s.kept for s in r.screens]})")
    if screen.est_ratio is None or len(screen.layers) != kept_n:
        what = "priced by bits" if screen.est_ratio is None else "recorded without its layers"
        raise QuantgateError(
            f"--kept {kept_n}: that screen was {what} ({r.priced_by or 'no profiles'}); re-run the search with "
            "profiles of fp16 and search.base"
        )
    kept = screen.layers
    args.work.mkdir(parents=True, exist_ok=True)
    recipe = args.work / "recipe.yaml"
    recipe.write_text(mixed_recipe(Path(p.recipe), kept, f"benchmarks.search_estimate: {kept_n} layers kept 16-bit"))
    build = f"{p.build}-k{kept_n}"
    block = load_block(f"quantize.{p.build}", QuantizeParams).model_copy(update={"recipe": str(recipe)})
    started = time.monotonic()
    quantize(build, Path("models") / BASELINE_BUILD, args.work / build, block)
    quantize_s = time.monotonic() - started
    serve, params = load_block("evaluate.serve", ServeParams), load_block("profile", ProfileParams)
    profile = measured(build, args.work / build, serve, params)
    price = load_block("cost", CostParams).gpu_hour_usd
    base_tps, base_usd = usd(read_profile(Path("results/profile") / f"{BASELINE_BUILD}.json"), price)
    tps, cost = usd(profile, price)
    rows = [
        {
            "kept": kept_n,
            "bits/weight": screen.effective_bits,
            "est $/1M tok": rounded(screen.est_ratio * base_usd, 4),
            "est x fp16": screen.est_ratio,
            "measured $/1M tok": rounded(cost, 4),
            "measured x fp16": rounded(cost / base_usd, 3),
            "measured tok/s": rounded(tps, 1),
            "fp16 tok/s": rounded(base_tps, 1),
            "error %": rounded(100 * (screen.est_ratio * base_usd - cost) / cost, 1),
        }
    ]
    report(
        "search_estimate",
        f"The search's cost estimate against the profile of its candidate ({kept_n} layers kept 16-bit)",
        rows,
        meta={"priced_by": r.priced_by, "quantize_s": rounded(quantize_s, 1), "profile": params.model_dump()},
        notes=[
            "fp16's figure is results/profile/fp16.json of this run (the estimate's own input); the candidate's "
            "is measured now, so machine noise between the two runs is in the error (profile TPOT ~15 %)."
        ],
    )


if __name__ == "__main__":
    run_main(main)
