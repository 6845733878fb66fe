"""Click commands of `quantgate canary` (wired into the CLI's `canary` group by pipeline/cli.py).

Thin: parse, call canary/, print; a QuantgateError becomes a click.ClickException (one line,
exit 1), never a traceback.
"""
from __future__ import annotations

from pathlib import Path

import click

from pipeline.errors import QuantgateError


@click.command("load")
@click.option("--url", required=True, help="Router (or any OpenAI server) base URL, e.g. http://127.0.0.1:8080")
@click.option("--rps", type=click.FloatRange(min=0, min_open=True), required=True, help="Requests per second offered.")
@click.option("--duration", type=click.FloatRange(min=0, min_open=True), required=True, help="Seconds of sending.")
@click.option("--evals", "evals_dir", type=click.Path(path_type=Path), default=Path("evals"), show_default=True,
              help="Team eval sets whose documents become prompts.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Prompts per task (default: all).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--arrivals", type=click.Choice(["poisson", "fixed"]), default="poisson", show_default=True)
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds per request.")
@click.option("--seed", type=int, default=0, show_default=True)
def load(url: str, rps: float, duration: float, evals_dir: Path, limit: int | None, max_tokens: int, arrivals: str,
         timeout_s: float, seed: int) -> None:
    """Open-loop load (greedy completions and chat, streaming and not) through the router; prints
    success rate, outcomes and latency percentiles."""
    from canary.load import prompts_from_evals, replay

    try:
        prompts = prompts_from_evals(evals_dir, limit)
        report = replay(url, prompts, rps, duration, max_tokens=max_tokens, timeout_s=timeout_s,
                        arrivals=arrivals, seed=seed)
    except QuantgateError as exc:
        raise click.ClickException(str(exc)) from None
    for line in report.lines():
        click.echo(line)


COMMANDS = [load]
