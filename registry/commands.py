"""Release-manager commands: register, approve, revoke, promote, rollback, history (wired into `quantgate`).

    quantgate register RUN_ID --override REASON [--by NAME]
    quantgate approve MODEL VERSION --reason TEXT [--by NAME] [--override REASON] [--recommend REASON]
    quantgate revoke MODEL VERSION --reason TEXT [--by NAME]
    quantgate promote MODEL VERSION --expect-production VERSION|none --reason TEXT [--by NAME] [--canary-run-id ID]
    quantgate rollback MODEL --reason TEXT [--by NAME] [--to previous|fallback]
    quantgate history MODEL [--at ISO-TIME]

Each parses (MODEL against MLflow's name rule: `model_arg`), calls registry/, prints; a QuantgateError or an
MLflow error is one line, no traceback.
`--by` defaults to $USER; against a server that authenticates, its user is recorded instead
and must have EDIT or MANAGE on the model (registry/access.py). The registry is
`MLFLOW_TRACKING_URI` (default ./mlflow.db).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone

import click

from quantgate.errors import QuantgateError, command_errors


@contextmanager
def registry_errors() -> Iterator[None]:
    """command_errors for a command that reads the registry: an MlflowException too is one line naming the tracking
    URI (exit 1), not a traceback (here, canary/commands.py, `quantgate serve`)."""
    from mlflow.exceptions import MlflowException

    from registry import store

    with command_errors(
        also=(MlflowException,), describe=lambda exc: f"MLflow at {store.tracking_uri()}: {one_line(exc.message)}"
    ):
        yield


def one_line(message: str) -> str:
    """An MLflow error message as one line, without the SQL statement and driver text a database
    error carries (e.g. psycopg's `StringDataRightTruncation ... [SQL: INSERT ...]`)."""
    text = re.split(r"\(psycopg|\(sqlite3\.|\[SQL:|\(Background on this error", message)[0]
    return " ".join(text.split())[:500] or "error"


def _client():
    from registry import store

    return store.client(existing=True)


def _acting(by: str, model: str | None, action: str) -> tuple[object, str]:
    """(client, who is recorded): against a server that authenticates, its user, whose
    permission on `model` is checked first (registry/access.py); else `--by` as given."""
    from click.core import ParameterSource

    from registry import access, store

    client = _client()
    uri = store.tracking_uri()
    user = access.authenticated_user(uri)
    if user is None:
        return client, by
    if model is not None:
        access.require_permission(uri, user, model, action)
    given = click.get_current_context().get_parameter_source("by") is not ParameterSource.DEFAULT
    if given and by != user:
        click.echo(f"note: the MLflow server authenticates you as {user}; recorded as {user}, not --by {by}", err=True)
    return client, user


def model_arg(ctx, param, value: str | None) -> str | None:
    """MODEL: a registered model's name (quantgate.register_params.model_name_problem: MLflow's rules, and for a
    command that changes the model, short enough for the registry lock's suffix; `status`, `history` and `canary
    render` only read) and not one of quantgate's registry locks. Raises click.BadParameter naming MODEL and the
    rule before the registry is touched; None passes (no MODEL). Used by every command taking MODEL (here,
    canary/commands.py, `quantgate serve`)."""
    from quantgate.register_params import model_name_problem
    from registry.lock import is_lock

    if value is None:
        return None
    if (problem := model_name_problem(value, locked=ctx.command.name not in READ_ONLY)) is not None:
        raise click.BadParameter(f"{value!r}: {problem.removeprefix(f'{value!r}: ')}")
    if is_lock(value):
        raise click.BadParameter(f"{value!r} is quantgate's registry lock, not a model; give the model's name")
    return value


READ_ONLY = ("status", "history", "render")  # commands that take no registry lock (render: `canary render`)


def version_arg(ctx, param, value: str) -> str:
    """A model version as MLflow numbers it (versions.version_number): "3", "v3" and "003" all give
    "3" (a zero-padded number would otherwise name Services and labels of a version that does not
    exist). Raises click.BadParameter for anything else, and for 0 (MLflow numbers versions from 1)."""
    from registry.versions import version_number

    extra = " or none" if param.name == "expect_production" else ""
    try:
        number = version_number(value)
    except QuantgateError:
        raise click.BadParameter(f"{value!r} is not a model version; give its number, e.g. 3 or v3{extra}") from None
    if number == "0":  # no registry holds it: asking one only said it does not exist
        raise click.BadParameter(
            f"{value!r}: MLflow numbers model versions from 1; give its number, e.g. 3 or v3{extra}"
        )
    return number


def by_arg(ctx, param, value: str | None) -> str:
    """--by: who acts (recorded), stripped. Raises click.BadParameter (a usage error, exit 2, naming --by) for a
    blank name, one with a newline or another control character (it would forge a line of the audit
    history), or one longer than the registry keeps, before the registry is touched; says when the blank came
    from $USER, its default."""
    from registry.approval import length_problem

    from_user = ctx.get_parameter_source(param.name) is click.core.ParameterSource.DEFAULT
    if from_user and (value is None or not value.strip()):  # e.g. CI: the MLflow user, when one is set
        value = os.environ.get("MLFLOW_TRACKING_USERNAME")
    if value is None or not value.strip():
        default = "its default, $USER (else $MLFLOW_TRACKING_USERNAME), is unset or empty here"
        why = default if from_user else "it is empty"
        raise click.BadParameter(f"{why}; name who is acting (it is recorded), e.g. --by alice")
    if not value.strip().isprintable():  # a newline in a recorded name would forge a line of `history`
        raise click.BadParameter("must be one line of printable characters (it is recorded), e.g. --by alice")
    if (too_long := length_problem("by", value.strip())) is not None:
        raise click.BadParameter(too_long)
    return value.strip()


def by_option(help_text: str = "Who is acting (recorded)."):
    """--by: who acts (by_arg), default $USER, else $MLFLOW_TRACKING_USERNAME; for every command that records one."""
    return click.option(
        "--by",
        default=lambda: os.environ.get("USER"),
        required=True,
        callback=by_arg,
        show_default="$USER, else $MLFLOW_TRACKING_USERNAME",
        help=help_text,
    )


_by = by_option()


def text_arg(ctx, param, value: str | None) -> str | None:
    """Free text that is recorded (--reason, --override, --recommend) as one line: newlines and other
    control characters become spaces, so `history` shows one line per event and none can be forged.
    Given but blank, or longer than the registry keeps, is refused (click.BadParameter: a usage error, exit 2,
    naming the option), before the registry is touched."""
    from registry.approval import length_problem

    if value is None:
        return None
    text = " ".join("".join(c if c.isprintable() else " " for c in value).split())
    if not text:
        raise click.BadParameter("it is empty; say why (it is recorded)")
    if (too_long := length_problem(param.opts[0].removeprefix("--"), text)) is not None:
        raise click.BadParameter(too_long)
    return text


_reason = click.option("--reason", required=True, callback=text_arg, help="Why (recorded).")


def _run_id(ctx, param, value: str) -> str:
    """RUN_ID, a build run's id, stripped (one pasted with a space around it was 'does not exist'); a blank one
    (e.g. an unset shell variable) is a usage error (click.BadParameter, exit 2), refused before the registry is
    read."""
    if not value.strip():
        raise click.BadParameter(
            "it is empty; give the build's run id (`quantgate status` lists the unregistered ones)"
        )
    return value.strip()


def _canary_run_id(ctx, param, value: str | None) -> str | None:
    """--canary-run-id, stripped; a blank one (an unset shell variable) is a usage error (click.BadParameter, exit
    2) before the registry is read, as a blank RUN_ID is: it exited 1 with "canary run '' does not exist"."""
    if value is None:
        return None
    if not value.strip():
        raise click.BadParameter("it is empty; give the run id `quantgate canary run` printed for this version")
    return value.strip()


@click.command(short_help="Register build RUN_ID (from `quantgate status`) as a version.")
@click.argument("run_id", callback=_run_id)
@_by
@click.option(
    "--override",
    "override_reason",
    metavar="REASON",
    callback=text_arg,
    help="Register although the build's gate.verdict is not PASS; REASON is recorded and audited.",
)
def register(run_id: str, by: str, override_reason: str | None) -> None:
    """Make build run RUN_ID (from `quantgate status`) a model version; a build that did not PASS needs --override."""
    from registry import runs, tags

    with registry_errors():
        client, by = _acting(by, None, "register")  # the server checks EDIT on the model itself
        mv = runs.register_run(client, run_id, by, override_reason)
    override = mv.tags.get(tags.REGISTERED_OVERRIDE)
    click.echo(
        f"{mv.name} v{mv.version}: registered build {mv.tags[tags.BUILD]} from run {run_id}, "
        f"gate.verdict={mv.tags[tags.VERDICT]}" + (f", overriding the gate: {override}" if override else "")
    )
    if override:
        click.echo(
            f"next: quantgate approve {mv.name} {mv.version} --reason ... --override REASON "
            "(approving a build that did not PASS needs its own override)"
        )
    elif override_reason:
        click.echo("note: the build passes its gate; --override was not needed and is not recorded")


@click.command(short_help="Approve MODEL VERSION for serving; promote and canary need it.")
@click.argument("model", callback=model_arg)
@click.argument("version", callback=version_arg)
@_by
@_reason
@click.option(
    "--override",
    "override_reason",
    metavar="REASON",
    callback=text_arg,
    help="Approve although gate.verdict is not PASS; REASON is recorded.",
)
@click.option(
    "--recommend",
    "recommend_reason",
    metavar="REASON",
    callback=text_arg,
    help="Override the gate's recommendation (cheaper than 16-bit where measured) to yes; REASON is recorded.",
)
def approve(
    model: str, version: str, by: str, reason: str, override_reason: str | None, recommend_reason: str | None
) -> None:
    """Approve MODEL VERSION for serving (needed before promote and candidate); shows its recommendation."""
    from registry import approval, versions

    with registry_errors():
        client, by = _acting(by, model, "approve")
        if recommend_reason is not None:  # the baseline has no recommendation: refused before the approval
            problem = approval.recommend_problem(versions.require_version(client, model, version).tags)
            if problem is not None:
                raise QuantgateError(f"{model} v{version}: --recommend refused: {problem}")
        a = approval.approve(client, model, version, by, reason, override_reason)
        if recommend_reason is not None:
            _, reco = approval.override_recommendation(client, model, version, by, recommend_reason)
        else:
            _, reco = approval.read_recommendation(versions.require_version(client, model, version).tags)
    click.echo(
        f"{model} v{version}: {'already ' if a.unchanged else ''}{a.why}"
        + (" (the same approval; nothing recorded)" if a.unchanged else "")
    )
    click.echo(f"{model} v{version}: {reco}")
    if override_reason and not a.override:
        click.echo("note: the version passes its gate; --override was not needed and is not recorded")


@click.command(short_help="Revoke MODEL VERSION's approval: it can no longer be promoted.")
@click.argument("model", callback=model_arg)
@click.argument("version", callback=version_arg)
@_by
@_reason
def revoke(model: str, version: str, by: str, reason: str) -> None:
    """Revoke the approval of MODEL VERSION (it can no longer be promoted); on a version never approved, a veto."""
    from registry import aliases, approval, versions

    advice = {  # what each alias still does with a revoked version (production's: _production_advice)
        aliases.CANDIDATE: "the canary must drop it",
        aliases.FALLBACK: "failed requests are still retried on it (the gateway's 16-bit baseline), but no "
        f"rollback goes to it now (`rollback --to fallback` is refused until `quantgate approve {model} "
        f"{version}`); a build to replace it comes from `dvc repro`",
    }
    with registry_errors():
        client, by = _acting(by, model, "revoke")
        a = approval.revoke(client, model, version, by, reason)
        serving = sorted(
            al
            for al, v in aliases.current(client, model).items()
            if v == versions.version_number(version) and (al in advice or al == aliases.PRODUCTION)
        )
        if aliases.PRODUCTION in serving:
            advice[aliases.PRODUCTION] = _production_advice(client, model, version)
    if a.was == "none":  # nothing to take back: say what was recorded
        click.echo(
            f"{model} v{version}: was never approved (no `approval` tag); recorded a veto: {a.why} "
            f"(no promote, candidate or rollback goes to it until it is approved)"
        )
    else:
        click.echo(f"{model} v{version}: " + ("was already revoked; again: " if a.was == "revoked" else "") + a.why)
    for al in serving:
        click.echo(f"warning: v{version} is still {al!r}; {advice[al]}")


def _production_advice(client, model: str, version: str) -> str:
    """What to do about production still on the revoked `version`: the rollback that would be taken, else a
    promote (a rollback to a target that is unset, production itself or revoked is refused)."""
    from registry import aliases

    targets = aliases.rollback_targets(client, model)
    if aliases.PREVIOUS in targets:
        return f"run `quantgate rollback {model} --reason ...` (to previous)"
    if aliases.FALLBACK in targets:
        return f"run `quantgate rollback {model} --to fallback --reason ...` (the 16-bit build)"
    return (
        "no rollback would take it anywhere (previous and fallback are unset, this version, or revoked); promote "
        f"an approved version: `quantgate promote {model} VERSION --expect-production {version} --reason ...`"
    )


def _version_or_none(ctx, param, value: str) -> str | None:
    return None if value.strip().lower() == "none" else version_arg(ctx, param, value)


@click.command(short_help="Make MODEL VERSION production (approved; weights verified).")
@click.argument("model", callback=model_arg)
@click.argument("version", callback=version_arg)
@click.option(
    "--expect-production",
    required=True,
    callback=_version_or_none,
    metavar="VERSION|none",
    help="The version you believe is production now (none if there is none); if it is not, nothing changes.",
)
@_by
@_reason
@click.option(
    "--canary-run-id",
    callback=_canary_run_id,
    help="The MLflow run of this version's canary that passed every step, supporting this promotion (recorded).",
)
def promote(
    model: str, version: str, expect_production: str | None, by: str, reason: str, canary_run_id: str | None
) -> None:
    """Make MODEL VERSION production (it must be approved; its weights are verified first)."""
    from registry import aliases

    with registry_errors():
        client, by = _acting(by, model, "promote")
        changes = aliases.promote(client, model, version, expect_production, by, reason, canary_run_id)
    for c in changes:
        click.echo(f"{model}: {c}")
    if not changes:
        click.echo(f"{model}: v{version} already is production; nothing changed")


@click.command(short_help="Point MODEL's production back at previous (or --to fallback).")
@click.argument("model", callback=model_arg)
@_by
@_reason
@click.option(
    "--to",
    "to",
    type=click.Choice(["previous", "fallback"]),
    default="previous",
    show_default=True,
    help="The alias production goes back to: previous (the version production had before) or fallback (the "
    "16-bit baseline build).",
)
def rollback(model: str, by: str, reason: str, to: str) -> None:
    """Point MODEL's production alias back at `previous` (or the 16-bit `fallback`)."""
    from registry import aliases

    with registry_errors():
        client, by = _acting(by, model, "rollback")
        changes = aliases.rollback(client, model, by, reason, to)
    for c in changes:
        click.echo(f"{model}: {c}")


def _when(ctx, param, value: str | None) -> datetime | None:
    """--at: an ISO time (no zone = UTC) or `now`, as an aware UTC datetime. Raises click.BadParameter naming --at
    for text that is no ISO time, or a time that lies outside years 1-9999 once in UTC."""
    if value is None:
        return None
    if value.strip().lower() == "now":
        from registry.audit import utc_now

        ctx.meta["history_at_now"] = True
        return utc_now()
    try:
        at = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an ISO time (e.g. 2025-06-01T12:00:00Z; no zone = UTC)") from None
    if at.tzinfo is None:  # as --help says: no zone = UTC
        return at.replace(tzinfo=timezone.utc)
    try:  # e.g. 0001-01-01T00:00:00+01:00 is in year 0 in UTC, which datetime cannot hold
        return at.astimezone(timezone.utc)
    except OverflowError:
        raise click.BadParameter(
            f"{value!r} is not a usable time: in UTC it falls outside the years 1-9999; give a time within them"
        ) from None


@click.command()
@click.argument("model", callback=model_arg)
@click.option(
    "--at",
    "at",
    callback=_when,
    metavar="ISO-TIME|now",
    help="Show the aliases as they were at this time (no zone = UTC).",
)
def history(model: str, at: datetime | None) -> None:
    """The audited alias and approval changes of MODEL, oldest first."""
    from registry import aliases, audit

    with registry_errors():
        client = _client()
        aliases.current(client, model)  # QuantgateError if the model is not registered here
        if at is not None:
            live = click.get_current_context().meta.get("history_at_now", False) or at >= audit.utc_now()
            existing = {str(mv.version) for mv in client.search_model_versions(f"name='{model}'")}
            for alias, version in aliases.aliases_at(client, model, at).items():
                click.echo(f"{alias}={_shown(version, existing, live)}")
            return
        events = audit.history(client, model)
    for e in events:
        click.echo(e.line())
    if not events:
        click.echo(f"{model}: no audited changes")


def _shown(version: str | None, existing: set[str], live: bool) -> str:
    """An alias's version from the audit trail as `history --at` prints it; a version deleted
    outside quantgate since (the trail cannot know) is said, and is none when asked about now."""
    if version is None:
        return "none"
    if version in existing:
        return f"v{version}"
    return f"none (v{version} per the audit trail, deleted since)" if live else f"v{version} (deleted since)"


COMMANDS = [register, approve, revoke, promote, rollback, history]
