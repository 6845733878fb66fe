"""Click commands of `quantgate canary` (wired into the CLI's `canary` group by cli/main.py).

    quantgate canary run MODEL VERSION [--load-rps RPS]    the canary here: promote or abort
    quantgate canary run MODEL VERSION --gateway ADMIN_URL the canary on a running `quantgate serve`
    quantgate canary load --url URL --rps RPS --duration S replay eval prompts through a router
    quantgate canary render MODEL VERSION --format gateway-api [--step N|rollback] [--out FILE]
                                                           the same steps as HTTPRoutes for a cluster

Thin: parse, call canary/, print; errors take the CLI's one path, quantgate.errors.command_errors (one line,
exit 1; registry.commands.registry_errors where the registry is read, MLflow's errors too), never a traceback.
`canary load` exits 1 when any request failed; `canary run` 3 on abort.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from canary.load import APIS, LoadOptions, prompts_from_evals, read_team_keys, replay, unkeyed
from canary.render import label_problem, subdomain_problem, template_problem
from quantgate.errors import QuantgateError, command_errors
from quantgate.options import EVALS, IN_FILE, PATH, RATE, SECONDS, SOMETIMES_READ, grouped, path_option
from registry.commands import by_option, model_arg, registry_errors, version_arg
from registry.versions import version_number

if TYPE_CHECKING:
    from canary.controller import Hooks

TOKEN_FILE_DEFAULT = ".quantgate/serve/admin.token"  # `quantgate serve`'s WORK_DIR/admin.token: --token-file's default


def _api_choice(*decls: str, default: str, help_text: str):
    """An option choosing the endpoints of replayed traffic (canary.load.APIS)."""
    return click.option(*decls, type=click.Choice(list(APIS)), default=default, show_default=True, help=help_text)


def _team_keys(ctx, param, value: Path | None) -> dict[str, str] | None:
    """--team-keys: the file read (canary.load.read_team_keys) while the arguments are parsed, so a bad file is a
    usage error naming the option (exit 2) before any request or alias change."""
    if value is None:
        return None
    try:
        return read_team_keys(value)
    except QuantgateError as exc:
        raise click.BadParameter(str(exc)) from None


def _header(ctx, param, value: str) -> str:
    """--team-header: an HTTP header name (gateway.limits.header_name_problem), lower case as the gateway reads it."""
    from gateway.limits import header_name_problem

    if why := header_name_problem(value):
        raise click.BadParameter(why)
    return value.lower()


def _team_keys_option():
    """--team-keys FILE: each team's prompts carry `Authorization: Bearer <its key>` (canary.load.read_team_keys),
    for a gateway that tells teams by API key (limits.team_keys_file)."""
    return click.option(
        "--team-keys",
        "team_keys",
        type=IN_FILE,
        default=None,
        callback=_team_keys,
        metavar="FILE",
        help="YAML {team: API key}: send each team's prompts with its key, for a gateway whose limits.team_keys_file "
        "tells teams by key (it ignores the team header then).",
    )


def http_url(value: str, option: str, what: str, example: str) -> str:
    """`value` stripped, when it is an http(s) URL with a host and a port in 1-65535 (or none). Raises
    QuantgateError naming `option` and saying to give `what` URL, e.g. `example`, otherwise."""
    import httpx

    url = value.strip()
    try:
        parsed = httpx.URL(url)
        port_ok = parsed.port is None or 1 <= parsed.port <= 65535
    except (httpx.InvalidURL, ValueError, TypeError):
        parsed, port_ok = None, False
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host or not port_ok:
        raise QuantgateError(f"{option} {value!r}: give {what} http(s) URL with its host and port, e.g. {example}")
    return url


def gateway_url(value: str) -> str:
    """--gateway: http_url of the gateway's admin endpoint. Raises QuantgateError naming --gateway otherwise."""
    return http_url(value, "--gateway", "the admin endpoint's", "http://127.0.0.1:8001 (`quantgate serve` prints it)")


def _url_arg(check: Callable[[str], str]):
    """A click callback: the option's value through `check` (an http_url), a bad URL a usage error (exit 2) naming
    the option, as every other bad value is, before anything is read or sent."""

    def callback(ctx, param, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return check(value)
        except QuantgateError as exc:
            raise click.BadParameter(str(exc).removeprefix(f"{param.opts[0]} ")) from None

    return callback


def _router_url(value: str) -> str:
    """`canary load --url`: http_url of the router (or any OpenAI server)."""
    return http_url(value, "--url", "the router's (or an OpenAI server's)", "http://127.0.0.1:8080")


@click.command("load", short_help="Replay eval prompts through a router at --rps; report latencies.")
@click.option(
    "--url",
    required=True,
    callback=_url_arg(_router_url),
    help="Router (or any OpenAI server) base URL, e.g. http://127.0.0.1:8080",
)
@click.option("--rps", type=RATE, required=True, help="Requests per second offered.")
@click.option("--duration", type=SECONDS, required=True, help="Seconds of sending.")
@click.option(
    "--evals",
    "evals_dir",
    type=EVALS,
    default=Path("evals"),
    show_default=True,
    help="Team eval sets whose documents become prompts.",
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Prompts per task (default: all).")
@grouped(
    "options",
    LoadOptions,
    click.option(
        "--max-tokens",
        type=click.IntRange(min=1),
        default=16,
        show_default=True,
        help="max_tokens of each request (greedy: temperature 0).",
    ),
    click.option(
        "--arrivals",
        type=click.Choice(["poisson", "fixed"]),
        default="poisson",
        show_default=True,
        help="When requests are sent: poisson (random gaps, 1/--rps seconds on average) or fixed (every 1/--rps "
        "seconds).",
    ),
    click.option(
        "--timeout",
        "timeout_s",
        type=SECONDS,
        default=60.0,
        show_default=True,
        help="Seconds per request.",
    ),
    click.option(
        "--seed",
        type=int,
        default=0,
        show_default=True,
        help="Seed of the random choices: each request's prompt and the poisson gaps.",
    ),
    _api_choice("--api", default="both", help_text="Endpoints: /v1/chat/completions, /v1/completions or both in turn."),
    click.option(
        "--team-header",
        default="x-team",
        show_default=True,
        callback=_header,
        help="The header naming each prompt's team: the gateway's limits.team_header.",
    ),
    _team_keys_option(),
)
def load(url: str, rps: float, duration: float, evals_dir: Path, limit: int | None, options: LoadOptions) -> None:
    """Open-loop load (greedy completions and chat, streaming and not) through the router; prints
    success rate, outcomes and latency percentiles. Exits 1 if any request failed."""
    with command_errors():
        prompts = prompts_from_evals(evals_dir, limit)
        _say_unkeyed(prompts, options.team_keys)
        report = replay(url, prompts, rps, duration, **vars(options))
    for line in report.lines():
        click.echo(line)
    if report.ok < len(report.results):
        sys.exit(1)


def _say_unkeyed(prompts: list[str], team_keys: dict[str, str] | None) -> None:
    """One line naming the teams whose prompts go without a key although --team-keys was given."""
    if missing := unkeyed(prompts, team_keys):
        click.echo(
            f"load: --team-keys has no key for {', '.join(missing)}: those prompts go without one (a gateway that "
            "tells teams by key counts them as anonymous)"
        )


def _reuse(ctx, param, values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for v in values:
        version, sep, url = v.partition("=")
        version, url = version.strip(), url.strip()
        if not sep or not version or not url.startswith("http"):
            raise click.BadParameter(f"{v!r}: give VERSION=URL, e.g. 1=http://127.0.0.1:8001/v1")
        try:
            version = version_number(version)  # v1 and 1 are one version
        except QuantgateError as exc:
            raise click.BadParameter(f"{v!r}: {exc}") from None
        if version in out:  # once, the last silently won
            raise click.BadParameter(
                f"v{version} is given twice ({out[version]} and {url}); give one server per version"
            )
        try:
            out[version] = http_url(url, "--reuse", "a server's OpenAI", "http://127.0.0.1:8001/v1")
        except QuantgateError as exc:
            raise click.BadParameter(str(exc).removeprefix("--reuse ")) from None
    return out


def sigterm_as_ctrl_c() -> None:
    """Make SIGTERM (`kill`, a supervisor stopping the process) raise KeyboardInterrupt as Ctrl-C
    does, also inside a server start in progress, so the `finally` blocks run and stop the vLLM
    servers this process started (they run in their own sessions and would outlive it)."""
    import signal

    def terminate(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)


def operator_stops(stop: threading.Event) -> Callable[[], None]:
    """Ctrl-C (SIGINT) and SIGTERM for a canary: set `stop`, which the controller reads at every wait (the
    traffic measurement, the gateway's warm-up, each look), so the canary aborts on its normal path between
    registry writes: weight 0, `candidate` cleared, the abort recorded, servers stopped. Raising at an
    arbitrary point instead cut registry writes (a Ctrl-C during the promotion left a sqlite registry locked,
    the lock held and the run `promoting`) and could be swallowed (raised inside a weakref callback, it was
    ignored and the canary promoted). Inside a vLLM server's start (quantgate.serving.vllm_server on the
    stack, no registry write there) or on a second signal it interrupts at once (KeyboardInterrupt).
    Returns the function that puts the previous handlers back."""
    import signal

    from quantgate.serving import vllm_server

    starting = vllm_server.__wrapped__.__code__  # the generator's code, on the stack until the server is up

    def terminate(signum, frame):
        forced = stop.is_set()
        stop.set()
        while frame is not None and not forced:
            forced = frame.f_code is starting
            frame = frame.f_back
        if forced:
            raise KeyboardInterrupt

    before = {sig: signal.signal(sig, terminate) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, handler in before.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    return restore


@dataclass(frozen=True)
class CanaryLoad:
    """`canary run --load-rps`: eval-set prompts (from `evals_dir`, default evals) replayed through the canary's
    router at `rps` requests/s, `max_tokens` each, to the endpoints of `api` (canary.load.APIS); no load when
    `rps` is None."""

    rps: float | None
    max_tokens: int
    api: str
    evals_dir: Path | None
    team_keys: dict[str, str] | None = None  # --team-keys: each team's API key (canary.load.read_team_keys)
    team_header: str = "x-team"  # the running gateway's limits.team_header (run() reads params.yaml)
    notes: tuple[str, ...] = ()  # what on_gateway found amiss in the keys for the gateway's limits (printed once)

    def usage_problem(self, on_gateway: bool) -> str | None:
        """What is wrong with these options together, for a canary on a running gateway or (`on_gateway` False) on
        its own router, whose router tells no teams (every shadow sample is anonymous); None when nothing is."""
        for flag, given in (("--evals", self.evals_dir is not None), ("--team-keys", self.team_keys is not None)):
            if given and not self.rps:
                return f"{flag} is for the --load-rps prompts; give --load-rps too, or leave {flag} out"
        if self.team_keys is not None and not on_gateway:
            return (
                "--team-keys is for a running gateway that tells teams by key (--gateway): the canary's own router "
                "counts every prompt as anonymous; give --gateway, or leave --team-keys out"
            )
        return None

    def prompts(self) -> list[str]:
        """The prompts to replay (none without --load-rps). Raises QuantgateError naming --evals."""
        if not self.rps:
            return []
        try:
            return prompts_from_evals(self.evals_dir)  # run() gives the default with --load-rps (_default_evals)
        except QuantgateError as exc:
            raise QuantgateError(f"--evals: {exc}") from None

    def on_gateway(self) -> CanaryLoad:
        """This load as sent to a running `quantgate serve`: the team header its params.yaml `limits` name, and
        `notes` (_key_notes) where those limits tell teams by key (team_keys_file) and --team-keys is missing or
        holds a key whose digest that file does not list for its team (those prompts would count as anonymous),
        or where they do not and --team-keys is given (the keys change nothing there). Raises
        QuantgateError naming params.yaml's line for a bad limits block, or for an output cap
        (limits.max_output_tokens) under --max-tokens: the gateway would refuse every load request (HTTP 400)."""
        if not self.rps:
            return self
        from gateway.limits import Limits
        from quantgate.params import PARAMS_FILE, key_lines, load_block

        limits = load_block("limits", Limits)
        if self.max_tokens > (cap := limits.max_output_tokens):
            line = key_lines(PARAMS_FILE).get(("limits", "max_output_tokens"))
            at = f"{PARAMS_FILE}:{line}" if line else f"its default: {PARAMS_FILE} does not set it"
            raise QuantgateError(
                f"--max-tokens {self.max_tokens} is over the gateway's output cap of {cap} tokens "
                f"(limits.max_output_tokens, {at}): it would refuse every load request (HTTP 400); "
                f"give --max-tokens {cap} or less"
            )
        return dataclasses.replace(self, team_header=limits.team_header, notes=_key_notes(limits, self.team_keys))

    def starter(self, prompts: list[str], stop: threading.Event) -> Callable[[str], Callable[[], None]]:
        """Hooks.on_router: replay `prompts` through the router at the URL it is given, in a daemon thread,
        until `stop` is set; what it returns sets `stop` and waits for the requests in flight."""

        def start_load(url: str) -> Callable[[], None]:
            t = threading.Thread(
                target=replay,
                args=(url, prompts, self.rps, 24 * 3600.0),
                kwargs={
                    "stop": stop,
                    "max_tokens": self.max_tokens,
                    "api": self.api,
                    "team_header": self.team_header,
                    "team_keys": self.team_keys,
                },
                daemon=True,
            )
            t.start()

            def stop_load() -> None:  # before the router stops: let in-flight requests finish
                stop.set()
                t.join(timeout=120)

            return stop_load

        return start_load


def _key_notes(limits, team_keys: dict[str, str] | None) -> tuple[str, ...]:
    """Where `limits` (gateway.limits.Limits) tell teams by key: a line when `team_keys` is None (every replayed
    prompt counts as anonymous), and one per team whose key's digest limits.team_keys_file does not list for it
    (a typo, or another team's key); nothing when that file cannot be read here (the gateway read its own).
    Where they do not: a line when `team_keys` is given (the gateway reads only the team header)."""
    import hashlib

    from gateway.limits import read_team_keys as read_digests

    if not limits.team_keys_file:
        if team_keys is None:
            return ()
        return (
            f"params.yaml limits.team_keys_file is null: the gateway names teams by the {limits.team_header} header "
            "alone, so --team-keys changes nothing there",
        )
    if team_keys is None:
        return (
            f"params.yaml limits.team_keys_file ({limits.team_keys_file}) tells teams by API key, and the team header "
            "is ignored there: without --team-keys every prompt counts as anonymous",
        )
    try:
        team_of = read_digests(Path(limits.team_keys_file), limits.rate_limits.teams)
    except QuantgateError:
        return ()
    return tuple(
        f"--team-keys: {team}'s key is not one limits.team_keys_file ({limits.team_keys_file}) lists for {team}: "
        "its prompts count as anonymous (or as another team) there"
        for team, key in team_keys.items()
        if team_of.get(hashlib.sha256(key.encode()).hexdigest()) != team
    )


@dataclass(frozen=True)
class GatewayTarget:
    """`canary run --gateway`: a running `quantgate serve`'s admin endpoint (`admin_url`; None: the canary
    runs its own servers and router) and the file of its token (used when $QUANTGATE_ADMIN_TOKEN is unset or blank)."""

    admin_url: str | None
    token_file: Path | None  # None: given empty (an unset shell variable)

    def token(self) -> str:
        """The admin token for `admin_url` (gateway.admin.read_token; "" without one: the canary's own router needs
        none): $QUANTGATE_ADMIN_TOKEN, else the --token-file's. An empty --token-file is refused only where it would
        be read, as a usage error naming it (exit 2) that says to give the file or leave the option out; with the
        variable set the file is never read, so never checked, as its help says."""
        from gateway.admin import EmptyTokenFile, read_token

        if self.admin_url is None:
            return ""
        try:
            return read_token(self.token_file)
        except EmptyTokenFile as exc:
            raise click.BadParameter(
                f"{exc}, or leave --token-file out to read {TOKEN_FILE_DEFAULT}",
                ctx=click.get_current_context(silent=True),
                param_hint="'--token-file'",
            ) from None


@click.command("run", short_help="Canary MODEL VERSION through the policy steps; promote or abort.")
@click.argument("model", callback=model_arg)
@click.argument("version", callback=version_arg)
@by_option("Who runs the canary (recorded in the audit).")
@click.option(
    "--reuse",
    multiple=True,
    callback=_reuse,
    metavar="VERSION=URL",
    help="Use a running vLLM server for VERSION instead of starting one (repeatable; not verified).",
)
@grouped(
    "load",
    CanaryLoad,
    click.option(
        "--load-rps",
        "rps",
        type=RATE,
        default=None,
        help="Also replay eval-set prompts through the router at this rate (demos, tests).",
    ),
    click.option(
        "--max-tokens",
        type=click.IntRange(min=1),
        default=8,
        show_default=True,
        help="max_tokens of each --load-rps request.",
    ),
    _api_choice(
        "--load-api",
        "api",
        default="chat",
        help_text="Endpoints of --load-rps traffic (chat: what an instruct model serves in production).",
    ),
    click.option(
        "--evals",
        "evals_dir",
        type=EVALS,
        default=None,
        help="Team eval sets whose documents become the --load-rps prompts (default: evals).",
    ),
    _team_keys_option(),
)
@path_option("--work-dir", ".quantgate/canary", "Verified artifacts and server logs, one folder per canary run.")
@grouped(
    "gateway",
    GatewayTarget,
    click.option(
        "--gateway",
        "admin_url",
        default=None,
        callback=_url_arg(gateway_url),
        metavar="ADMIN_URL",
        help="Run on a running `quantgate serve` through its admin endpoint, e.g. http://127.0.0.1:8001 "
        "(its servers and router; no --reuse).",
    ),
    click.option(  # not IN_FILE: checked by read_token, and only when it reads the file (an empty one included)
        "--token-file",
        type=SOMETIMES_READ,
        default=Path(TOKEN_FILE_DEFAULT),
        show_default=True,
        help="The gateway's admin token, read (and checked) only when $QUANTGATE_ADMIN_TOKEN is unset or blank.",
    ),
)
def run(
    model: str, version: str, by: str, reuse: dict[str, str], load: CanaryLoad, work_dir: Path, gateway: GatewayTarget
) -> None:
    """Canary MODEL VERSION through the policy steps (params.yaml `canary`); promote or abort.

    Without --gateway it starts its own servers and router; with it, it drives the running gateway.
    Exit 0 when promoted; 3 when aborted (aliases unchanged), a first Ctrl-C or SIGTERM included; 1 on an error or
    an interrupt (a second Ctrl-C, or one while a vLLM server starts), saying the step reached; 2 on bad arguments.
    """
    from canary.controller import Admin, Interrupted, Local, run_canary, run_canary_on_gateway
    from canary.policy import load_policy, load_topology
    from gateway.fleet import load_fleet_params
    from quantgate.params import load_block
    from quantgate.serving import ServeParams
    from registry import store

    admin_url = gateway.admin_url
    if problem := _usage_problem(load, admin_url, reuse):
        raise click.UsageError(problem)
    if load.rps and load.evals_dir is None:  # the default, refused as `canary load` refuses it (exit 2)
        load = dataclasses.replace(load, evals_dir=_default_evals())
    stop, stop_load = threading.Event(), threading.Event()
    restore = operator_stops(stop)
    try:
        with registry_errors():
            token = gateway.token()  # the file only without $QUANTGATE_ADMIN_TOKEN
            prompts = load.prompts()  # a bad --evals is refused before any run, alias or server
            load = load.on_gateway() if admin_url else load
            # a running gateway says what share it shadows; a canary's own router takes params.yaml fleet.router
            router = None if admin_url else load_fleet_params().router
            hooks = _hooks(load, prompts, router.shadow_fraction if router else 0.5, stop, stop_load)
            client, policy = store.client(existing=True), load_policy()
            if admin_url:
                admin = Admin(admin_url, token)
                outcome = run_canary_on_gateway(client, model, version, policy, by, admin, hooks)
            else:
                local = Local(load_block("evaluate.serve", ServeParams), work_dir, load_topology(), router, reuse or {})
                outcome = run_canary(client, model, version, policy, by, local, hooks)
    except Interrupted as exc:  # the run was opened: it is recorded as aborted, with what changed on the way out
        o = exc.outcome
        if o.decision == "promoted":
            raise click.ClickException(
                f"canary run {o.run_id} of {model} v{version} promoted at step {o.step} ({o.percent:g}%), then "
                f"interrupted while it stopped: v{version} is production (`quantgate history {model}`)"
            ) from None
        changed = f"aliases: {'; '.join(o.changes)}" if o.changes else "no alias changed"
        raise click.ClickException(
            f"canary run {o.run_id} of {model} v{version} interrupted at step {o.step} ({o.percent:g}%): aborted "
            f"({o.reason}); {changed}"
        ) from None
    except KeyboardInterrupt:
        raise click.ClickException(
            f"canary of {model} v{version} interrupted before its run was opened: nothing recorded, no alias changed"
        ) from None
    finally:
        stop_load.set()
        restore()
    click.echo(f"canary run {outcome.run_id}: {outcome.decision} at step {outcome.step} ({outcome.percent:g}%)")
    if outcome.decision != "promoted":
        sys.exit(3)


def _default_evals() -> Path:
    """--evals left out with --load-rps: evals, checked as a given --evals is (EVALS, naming it as the default): a
    usage error (exit 2) when it is not a folder (the command runs outside the project folder), before anything
    is read."""
    ctx = click.get_current_context()
    param = next(p for p in ctx.command.params if p.name == "evals_dir")
    return EVALS.convert(Path("evals"), param, ctx)


def _usage_problem(load: CanaryLoad, admin_url: str | None, reuse: dict[str, str]) -> str | None:
    """What `canary run`'s options cannot mean together (a usage error, exit 2), before anything is read."""
    if admin_url and reuse:
        return "--reuse is for a canary with its own servers; the gateway serves every version"
    return load.usage_problem(admin_url is not None)


def _hooks(
    load: CanaryLoad, prompts: list[str], shadowed: float, stop: threading.Event, stop_load: threading.Event
) -> Hooks:
    """The controller's hooks for `canary run`: lines to stdout, `stop` set on Ctrl-C or SIGTERM, and the --load-rps
    traffic (planned at its rate, `shadowed` the share of greedy candidate requests mirrored), stopped
    through `stop_load`."""
    from canary.controller import Hooks
    from canary.plan import Traffic

    if not load.rps:
        return Hooks(click.echo, stop, None, None)
    _say_unkeyed(prompts, load.team_keys)
    for note in load.notes:
        click.echo(f"load: {note}")
    # every --load-api alternates streaming and not; all of it is greedy
    traffic = Traffic(load.rps, 0.5, 1.0, "--load-rps", shadowed)
    return Hooks(click.echo, stop, load.starter(prompts, stop_load), traffic)


def _step(ctx, param, value: str | None) -> str | None:
    number = value is not None and value.isascii() and value.isdigit() and len(value) < 5  # int() of 4300+ raises
    if value is None or value == "rollback" or (number and int(value) >= 1):
        return value
    raise click.BadParameter(f"{value!r}: give a step number (1, 2, ...) or rollback")


def _checked_by(problem: Callable[[str], str | None]):
    """A click callback refusing a value for which `problem` (canary.render.label_problem, subdomain_problem,
    template_problem) says
    why: a usage error (exit 2) naming the option, before the registry is read."""

    def callback(ctx, param, value: str) -> str:
        if (why := problem(value)) is not None:
            raise click.BadParameter(why)
        return value

    return callback


@dataclass(frozen=True)
class RouteTarget:
    """Where `canary render`'s HTTPRoutes point: the Gateway they attach to, their `namespace` (the Gateway's
    and the Services' too), and the builds' Services, named by the `service` template, on `port`
    (canary.render.RouteSplit's fields of the same names)."""

    gateway: str
    namespace: str
    port: int
    service: str


@click.command("render", short_help="Write the canary of MODEL VERSION as HTTPRoutes for a cluster.")
@click.argument("model", callback=model_arg)
@click.argument("version", callback=version_arg)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["gateway-api"]),
    required=True,
    help="gateway-api: one Kubernetes Gateway API HTTPRoute per policy step, then a rollback route.",
)
@grouped(
    "target",
    RouteTarget,
    click.option(
        "--gateway",
        default="inference-gateway",
        show_default=True,
        callback=_checked_by(subdomain_problem),  # names an existing Gateway: a DNS subdomain as given
        help="The Gateway the route attaches to.",
    ),
    click.option(
        "--namespace",
        default="default",
        show_default=True,
        callback=_checked_by(label_problem),
        help="Namespace of the route, Gateway and Services.",
    ),
    click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="The Services' port."),
    click.option(
        "--service",
        default="{model}-v{version}",
        show_default=True,
        callback=_checked_by(template_problem),
        help="Service name template ({model}, {version}), made a DNS label.",
    ),
)
@click.option("--step", callback=_step, metavar="N|rollback", help="Only this step's route (default: every route).")
@click.option("--out", type=PATH, help="Write here (default: stdout).")
def render(model: str, version: str, fmt: str, target: RouteTarget, step: str | None, out: Path | None) -> None:
    """Write the canary of MODEL VERSION as multi-document YAML for a cluster's rollout engine.

    Stable is resolved as `canary run` does (alias `production`, else `fallback`); VERSION must be
    approved and not already stable. Steps come from params.yaml `canary`. Nothing in the registry
    changes, and no analysis runs: whoever applies the routes judges each step (canary/README.md).
    """
    import yaml

    from canary.controller import preflight
    from canary.policy import load_policy
    from canary.render import http_routes
    from registry import store

    with registry_errors():
        steps = load_policy().steps
        if step not in (None, "rollback") and int(step) > len(steps):
            raise QuantgateError(
                f"--step {step}: the canary policy has {len(steps)} steps (params.yaml canary.steps); give a step from "
                f"1 to {len(steps)}, or rollback"
            )
        stable, _, _ = preflight(store.client(existing=True), model, version)
        routes = http_routes(model, stable, version, steps, **vars(target))
        if step is not None:
            routes = [routes[-1 if step == "rollback" else int(step) - 1]]
        text = yaml.safe_dump_all(routes, sort_keys=False)
        if out is None:
            click.echo(text, nl=False)
            return
        try:
            out.write_text(text)
        except OSError as exc:
            raise QuantgateError(f"cannot write {out}: {exc.strerror or exc}; give a writable --out") from None
    click.echo(f"wrote {len(routes)} HTTPRoute(s) for {model} v{stable} -> v{version} to {out}", err=True)


COMMANDS = [load, run, render]
