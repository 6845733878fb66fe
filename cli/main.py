"""The `quantgate` command, the composition root on top of every folder: parses arguments, calls pipeline/,
registry/, gateway/ or canary/, prints. Installed as the `quantgate` script; from a checkout `python -m cli`.

quantgate report                 the gate table of the last `dvc repro`
quantgate status [MODEL]         registered versions, verdicts and aliases; builds left unregistered
quantgate register RUN_ID --override REASON   register a build that did not PASS (registry/commands.py)
quantgate evals new TEAM         scaffold a valid team folder under evals/
quantgate evals validate [PATH]  check team eval sets without running a model
quantgate approve|revoke MODEL VERSION     release-manager approval (registry/commands.py)
quantgate promote|rollback|history MODEL   aliases and their audit trail
quantgate canary load --url URL            replay eval prompts through the router
quantgate serve MODEL                      the standing gateway: serves the registry aliases (gateway/serve.py)
quantgate canary render MODEL VERSION --format gateway-api   the canary's steps as HTTPRoutes (canary/commands.py)
"""

from __future__ import annotations

from pathlib import Path

import click

from quantgate.errors import QuantgateError, command_errors
from quantgate.options import IN_FILE, TEAM_FOLDERS, TEAMS_ROOT, path_option
from registry.commands import model_arg, one_line, registry_errors


@click.group()
def cli() -> None:
    """quantgate: quantize a shared model, gate each build per team, register, promote."""


GATE_JSON = Path("results/gate.json")  # what the gate stage of `dvc repro` writes


@cli.command()
@click.option(
    "--gate-json",
    type=IN_FILE,
    default=GATE_JSON,
    show_default=True,
    help="The gate's result to print, as the gate stage of `dvc repro` writes it (the search result beside it "
    "is read too).",
)
def report(gate_json: Path) -> None:
    """Print the gate table of the last pipeline run."""
    from pipeline.buys import buys_table
    from pipeline.gate import build_line, estimate_line, precision_line, search_of, table
    from quantgate.results import SEARCH_RESULT, check_consistent, read_gate

    if gate_json.is_dir():
        raise click.ClickException(f"{gate_json} is a folder; give the gate's JSON file (results/gate.json)")
    if not gate_json.is_file():
        if gate_json.resolve() == GATE_JSON.resolve():  # the default, however it is spelled
            raise click.ClickException(f"{gate_json} not found: run `dvc repro` first")
        raise click.ClickException(
            f"--gate-json {gate_json} not found: run `dvc repro` first and drop --gate-json (it writes "
            f"{GATE_JSON}, the default, only), or give an existing gate JSON file"
        )
    with command_errors():
        result = read_gate(gate_json)
        check_consistent(result, gate_json)  # a build milder than its worst team would print as shippable
        # says why two builds have one set of weights: the search beside the gate's file, not the one here
        search = search_of(gate_json.parent / SEARCH_RESULT.relative_to(GATE_JSON.parent))
    lines = [table(result), precision_line(result)]
    if result.buys:
        lines.append(buys_table(result))
    lines += [build_line(build, b, search) for build, b in result.builds.items()]
    lines += [estimate] if (estimate := estimate_line(result, search)) else []
    click.echo("\n".join(lines))


@cli.command(short_help="Registered versions, verdicts and aliases; unregistered builds.")
@click.argument("model", required=False, callback=model_arg)
def status(model: str | None) -> None:
    """Registered versions with verdicts and aliases, then the builds left unregistered (MODEL defaults to
    params register.model_name)."""
    from registry import store
    from registry.status import status_lines

    with command_errors(
        also=(Exception,),  # MlflowException and friends: a bad URI or an unreachable server
        describe=lambda exc: f"MLflow at {store.tracking_uri()}: {type(exc).__name__}: {one_line(str(exc))}",
    ):
        if model is None:
            from quantgate.params import PARAMS_FILE, load_block
            from quantgate.register_params import RegisterParams

            if not PARAMS_FILE.exists() and not PARAMS_FILE.is_symlink():  # load_block names a folder or broken link
                raise QuantgateError(
                    f"no {PARAMS_FILE} in {Path.cwd()}: run from the project folder, or name the "
                    f"model: quantgate status MODEL"
                )
            model = load_block("register", RegisterParams).model_name
        lines = status_lines(store.client(existing=True), model)
    for line in lines:  # printed outside: a closed pipe (`| head`) is click's quiet exit, not an MLflow error
        click.echo(line)


@cli.group(short_help="Team eval sets: scaffold a team folder, check the sets.")
def evals() -> None:
    """Team eval sets."""


_EXAMPLES = {"--owner": "--owner Ranking", "--contact": "--contact ranking-oncall@example.com"}


class _Asked(click.Option):
    """An option asked for when not given; when stdin has no more input to answer with (</dev/null, a CI job)
    a usage error (exit 2) naming the options, not click's bare `Aborted!`."""

    def prompt_for_value(self, ctx: click.Context):
        try:
            return super().prompt_for_value(ctx)
        except click.Abort as exc:
            if not isinstance(exc.__context__, EOFError):  # Ctrl-C: the user's own stop
                raise
            click.echo()  # end the prompt's line
            flag = self.opts[0]
            missing = [k for k in _EXAMPLES if k == flag or ctx.params.get(k[2:]) is None]  # --contact: not yet
            raise click.UsageError(  # a missing option, as click's own "Missing option": exit 2
                f"{flag} was not given and stdin ended before it could be asked for; give {' and '.join(missing)} "
                f"on the command line, e.g. {' '.join(_EXAMPLES[k] for k in missing)}"
            ) from None


def _one_line(ctx, param, value: str | None) -> str | None:
    """--owner, --contact: written to team.yaml and printed by validate, so one line of printable characters
    (a newline would print as two lines of the report) of at most teams.MAX_PERSON, as validate reads team.yaml;
    a no-break or other Unicode space is written as a plain one (teams.plain_spaces). Raises click.BadParameter
    (a usage error, exit 2, naming the option) for a blank one too, before anything is written."""
    from quantgate.teams import MAX_PERSON, plain_spaces

    if value is None:
        return None
    value, example = plain_spaces(value), _EXAMPLES[f"--{param.name}"]
    if not value.strip():  # at a prompt, asked again; gate-failure notices would go to nobody
        raise click.BadParameter(f"it is blank; say whom the gate reports to, e.g. {example}")
    if not value.isprintable():
        raise click.BadParameter(
            "must be one line of printable characters (it is written to team.yaml and printed by validate), "
            f"e.g. {example}"
        )
    if len(value) > MAX_PERSON:
        raise click.BadParameter(
            f"{len(value)} characters; at most {MAX_PERSON} (it is written to team.yaml and printed by validate): "
            f"give a team's name or an address, e.g. {example}"
        )
    return value


def _team_name(ctx, param, value: str) -> str:
    """TEAM: a name a team folder can have (quantgate.teams.TEAM_NAME); any other is a usage error
    (click.BadParameter, exit 2, naming TEAM) before anything is read or written."""
    from quantgate.teams import TEAM_NAME, TEAM_NAME_RULE

    if not TEAM_NAME.fullmatch(value):
        raise click.BadParameter(f"{value!r}: {TEAM_NAME_RULE}")
    return value


@evals.command("new", short_help="Scaffold a valid team folder evals/TEAM with example documents.")
@click.argument("team", callback=_team_name)
@click.option("--owner", cls=_Asked, prompt=True, callback=_one_line, help="The team that owns the set.")
@click.option(
    "--contact",
    cls=_Asked,
    prompt=True,
    callback=_one_line,
    help="Who to tell when the gate fails (e-mail, channel).",
)
@click.option(
    "--root",
    type=TEAMS_ROOT,
    default=Path("evals"),
    show_default=True,
    is_eager=True,  # checked before --owner and --contact are asked for
    help="The existing folder that holds the team folders; TEAM's folder is created in it.",
)
def new(team: str, owner: str, contact: str, root: Path) -> None:
    """Scaffold a valid team folder evals/TEAM with example documents to replace."""
    from quantgate.scaffold import new_team

    with command_errors():
        t = new_team(root, team, owner, contact)
    folder = t.path
    click.echo(
        f"created {folder}: {', '.join(p.name for p in sorted(folder.iterdir()))} ({t.tasks[0].n_docs} example docs)"
    )
    click.echo(
        f"next: replace {folder / 'data.jsonl'} with your documents, then "
        f"`quantgate evals validate {folder}` and `dvc repro`"
    )


@evals.command(short_help="Check the team eval sets under PATH without running a model.")
@click.argument("path", type=TEAM_FOLDERS, default=Path("evals"))
def validate(path: Path) -> None:
    """Check the team eval sets under PATH (default: evals; or one team folder) without running a model.

    A team's calibration.jsonl is checked too, against every team's eval documents (for one team folder: its
    own and those of the team folders beside it that validate)."""
    from quantgate.budget import budget_source, check_budget_teams, load_budgets
    from quantgate.calibration import CHECKED, TEAM_FILE, eval_strings, team_conversations
    from quantgate.teams import POLICY_FILE, load_team, load_teams, teams_beside

    scope, strings = "", None  # None: team_conversations reads the teams' documents if some team has the file
    with command_errors():
        budgets = load_budgets(required=False)  # params.yaml of the project folder it runs in, else the defaults
        folder = path.parent if (path / POLICY_FILE).is_file() else path
        if folder.is_dir():  # a misspelled validate.teams key would leave its team on the shared budget
            check_budget_teams(budgets, sorted(p.name for p in folder.iterdir() if (p / POLICY_FILE).is_file()))
        if (path / POLICY_FILE).is_file():
            teams = [load_team(path, budgets)]
            if (path / TEAM_FILE).is_file():  # compared with the teams beside it too: loaded only then
                others, broken = teams_beside(path)
                strings = eval_strings(teams + others)
                if broken:  # their documents could not be read: say so rather than claim a comparison
                    scope = f" (not compared with {', '.join(broken)}: they do not validate)"
        else:
            teams = load_teams(path, budgets=budgets)
        own = team_conversations(teams, strings)
    for t in teams:
        tasks = ", ".join(f"{x.name}, {x.n_docs} docs" for x in t.tasks)
        policy = t.policy
        click.echo(f"ok: {t.name} ({tasks}), owner {policy.owner}, metric {policy.metric}; per build {t.cost.line()}")
    if own:
        click.echo(f"ok: {len(own)} team calibration conversations, {CHECKED}{scope}")
    click.echo(f"budget: {budget_source()}")


def _host(ctx, param, value: str | None) -> str | None:
    """--host: an address to listen on (gateway.fleet.check_host); a blank one (every interface, said as
    http://:PORT) is a usage error (click.BadParameter, exit 2, naming --host) before params.yaml or the registry
    is read."""
    from gateway.fleet import check_host

    if value is None:
        return None
    try:
        return check_host(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _own_ports(port: int | None, admin_port: int | None) -> None:
    """--port and --admin-port given as one port (not 0, a free one each): a usage error (exit 2) before params.yaml
    or the registry is read; a clash with params.yaml's ports is the fleet block's to refuse (gateway/serve.py)."""
    if port and port == admin_port:
        raise click.UsageError(
            f"--port and --admin-port are both {port}: the gateway and its admin endpoint need a port each; give "
            "each its own (0: a free one)"
        )


@cli.command("serve", short_help="Serve MODEL's registry aliases behind one OpenAI endpoint.")
@click.argument("model", callback=model_arg)
@click.option(
    "--host", default=None, callback=_host, help="Gateway address (default: params.yaml fleet.host, 127.0.0.1)."
)
@click.option(
    "--port", type=click.IntRange(0, 65535), default=None, help="Gateway port (default: fleet.port; 0: free)."
)
@path_option("--work-dir", ".quantgate/serve", "Verified artifacts, server logs and pids, one folder per version.")
@click.option(
    "--admin-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Admin endpoint port (default: fleet.admin.port; 0: free). Token: $QUANTGATE_ADMIN_TOKEN, "
    "else WORK_DIR/admin.token.",
)
def serve(model: str, host: str | None, port: int | None, work_dir: Path, admin_port: int | None) -> None:
    """Serve MODEL's registry aliases behind one OpenAI endpoint until Ctrl-C or SIGTERM.

    Run it from the project folder: the registry is $MLFLOW_TRACKING_URI (default ./mlflow.db),
    settings are params.yaml `fleet` and `limits`. production (else fallback) takes the traffic;
    fallback, candidate and previous are kept warm, each from weights verified against the
    registry. Alias changes (promote, rollback, a canary) are followed within a second: a poll
    every fleet.poll_s, and at once through an MLflow webhook when the registry is an `mlflow
    server` (fleet.webhook). A failed production request is retried on fallback, dead servers are
    restarted. An admin endpoint (fleet.admin, loopback, bearer token) lets `quantgate canary run
    --gateway` set the split and read the samples.

    \b
    Example:
      quantgate serve smollm2-135m-instruct        # OpenAI API at http://127.0.0.1:8000/v1
      curl -s localhost:8000/health                # the serving version and the warm servers
    """
    from canary.commands import sigterm_as_ctrl_c
    from canary.policy import load_policy
    from canary.status import reap_stale
    from gateway.fleet import load_fleet_params
    from gateway.limits import load_limits
    from gateway.serve import Settings, run_gateway
    from quantgate.params import load_block
    from quantgate.serving import ServeParams
    from registry import store

    _own_ports(port, admin_port)
    sigterm_as_ctrl_c()
    try:
        with registry_errors():
            params = load_fleet_params()
            params = params.model_copy(update={k: v for k, v in {"host": host, "port": port}.items() if v is not None})
            if admin_port is not None:
                params = params.model_copy(update={"admin": params.admin.model_copy(update={"port": admin_port})})
            serve_params, limits, stale_after_s = (
                load_block("evaluate.serve", ServeParams),
                load_limits(),
                (load_policy().stale_after_s),
            )
            client = store.client(existing=True)
            try:  # a gateway starts at 0 %: canaries whose controller died are over (canary/status.py)
                reap_stale(client, model, stale_after_s, "quantgate serve", click.echo)
            except Exception as exc:  # the registry unreachable: serve anyway; the next canary run reaps
                click.echo(
                    f"serve: could not check for canaries left by a dead controller: {type(exc).__name__}: {exc}"
                )
            run_gateway(client, model, Settings(serve_params, params, limits), work_dir, log=click.echo)
    except KeyboardInterrupt:
        click.echo("serve: stopped (Ctrl-C or SIGTERM)")


@cli.group(short_help="The release canary: traffic in steps, then promote or abort.")
def canary() -> None:
    """The release canary: traffic in steps through a gateway, live analysis, promotion or abort."""


def _wire() -> None:
    """Commands that live beside their logic (registry/commands.py, canary/commands.py)."""
    from canary.commands import COMMANDS as CANARY
    from registry.commands import COMMANDS as REGISTRY

    for command in REGISTRY:
        cli.add_command(command)
    for command in CANARY:
        canary.add_command(command)


_wire()


def main() -> None:
    import os

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one line per download, not a bar
    cli(prog_name="quantgate")


if __name__ == "__main__":
    main()
