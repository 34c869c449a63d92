"""`loom`: the platform from a shell, over its REST API and run websocket, with the token `loom login`
saved (or LOOM_URL and LOOM_TOKEN); `loom plan` runs the planner on this machine."""

import time
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.live import Live
from rich.table import Table

from .client import LoomClient
from .credentials import Credentials, load_credentials, save_credentials
from .documents import DocumentError, load_document, parse_overrides, with_overrides
from .exit_codes import OUTCOMES, reports_errors
from .models import RunDetail
from .plan_commands import plan_app
from .watch_view import WatchView

# `run watch` starts with the run's latest events (this many), so a run watched midway shows its recent steps.
HISTORY_EVENTS = 500
# How often `run watch` asks for the run's state and alerts besides when a state event arrives.
LOOK_EVERY_S = 5.0
FOLLOW_INTERVAL_S = 1.0

app = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="The loom platform from a shell (runs, logs, checkpoints, restores) and the planner on this machine.",
)
run_app = typer.Typer(
    no_args_is_help=True,
    help="One run: submit, show, cancel, clone, watch; tag, untag, note, rename, archive, unarchive.",
)
config_app = typer.Typer(no_args_is_help=True, help="A run's config document.")
app.add_typer(run_app, name="run")
app.add_typer(config_app, name="config")
app.add_typer(plan_app, name="plan")

console = Console()

RunId = Annotated[int, typer.Argument(help="the run's id (loom runs lists them)")]
Changes = Annotated[
    list[str] | None,
    typer.Option("--set", help="PATH=VALUE, a dotted config path and a YAML value: --set parallel.tp=2 (repeatable)"),
]


def connected() -> LoomClient:
    credentials = load_credentials()
    return LoomClient(credentials.url, credentials.token)


@app.command()
@reports_errors
def login(
    url: Annotated[str, typer.Argument(help="the platform's address, such as https://loom.example.org")],
    token: Annotated[str | None, typer.Option(help="an API token (asked for, hidden, when not given)")] = None,
):
    """Check an API token against the platform and keep both for the other commands."""
    token = token or typer.prompt("API token", hide_input=True)
    with LoomClient(url, token) as client:
        list(client.runs(limit=1))
    path = save_credentials(Credentials(url.rstrip("/"), token))
    typer.echo(f"logged in to {url.rstrip('/')}; credentials saved in {path}")


@app.command("runs")
@reports_errors
def list_runs(
    state: Annotated[
        str | None, typer.Option(help="only runs in these states, comma-separated (queued, running, succeeded, …)")
    ] = None,
    tag: Annotated[str | None, typer.Option(help="only runs with this tag")] = None,
    search: Annotated[str | None, typer.Option(help="only runs whose name, a tag or the note holds this text")] = None,
    archived: Annotated[bool, typer.Option("--archived", help="the archived runs instead of the live ones")] = False,
    sort: Annotated[str, typer.Option(help="created, updated, name or state; -name for the other way")] = "-created",
    limit: Annotated[int, typer.Option(help="show at most this many runs")] = 50,
):
    """Your runs, newest first: layout, progress, last loss, tokens/s, duration, open alerts, tags."""
    with connected() as client:
        runs = list(
            client.runs(search=search or "", state=state or "", tag=tag or "", archived=archived, sort=sort,
                        limit=limit)
        )  # fmt: skip
    table = Table("id", "name", "state", "layout", "steps", "loss", "tokens/s", "duration", "alerts", "tags", "note",
                  "created")  # fmt: skip
    for run in runs:
        steps = f"{run.steps_done if run.steps_done is not None else '-'}/{run.steps_total}"
        table.add_row(
            str(run.id), run.name, run.state, layout_of(run.layout), steps,
            "" if run.last_loss is None else f"{run.last_loss:.4f}",
            "" if run.tokens_per_s is None else f"{run.tokens_per_s:,.0f}",
            duration_of(run.duration_s), alerts_of(run.open_alerts, run.critical_alerts), ", ".join(run.tags),
            run.note.partition("\n")[0][:40], f"{run.created_at.astimezone():%Y-%m-%d %H:%M:%S}",
        )  # fmt: skip
    console.print(table)


def duration_of(seconds: float | None) -> str:
    """3h 05m, 4m 10s, 12s; empty for a run that has not started."""
    if seconds is None:
        return ""
    whole = int(seconds)
    hours, minutes, left = whole // 3600, whole // 60 % 60, whole % 60
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {left:02d}s" if minutes else f"{left}s"


def alerts_of(live: int, critical: int) -> str:
    if not live:
        return ""
    return f"{live} open ({critical} critical)" if critical else f"{live} open"


@run_app.command()
@reports_errors
def submit(
    file: Annotated[Path, typer.Argument(help="run-config document, YAML or JSON")],
    changes: Changes = None,
    name: Annotated[str | None, typer.Option(help="the run's name (default: the file's name)")] = None,
    cluster: Annotated[Path | None, typer.Option(help="a cluster (YAML or JSON) to store an estimate for")] = None,
    follow: Annotated[bool, typer.Option(help="then watch it as `loom run watch` does")] = False,
):
    """Create a run from a config file and queue it."""
    config = with_overrides(load_document(file), parse_overrides(changes or []))
    cluster_document = load_document(cluster) if cluster else None
    with connected() as client:
        run = client.submit(name or file.stem, config, cluster_document)
        typer.echo(f"run {run.id} ({run.name}): {run.state}")
        for field, message in run.warnings.items():
            typer.echo(f"warning: {field}: {message}", err=True)
        if follow:
            raise typer.Exit(watch_to_the_end(client, run.id))


@run_app.command()
@reports_errors
def show(run_id: RunId):
    """A run's state, attempts and where it came from."""
    with connected() as client:
        run = client.run(run_id)
    console.print(f"run {run.id} [bold]{run.name}[/bold]: {run.state}", highlight=False)
    console.print(f"created {run.created_at.astimezone():%Y-%m-%d %H:%M:%S}, {run.config.get('steps')} steps")
    if run.forked_from_run is not None:
        console.print(f"forked from run {run.forked_from_run} at step {run.forked_from_step}")
    attempts = Table("attempt", "state", "trigger", "ranks", "layout", "exit", "why", title="attempts")
    for attempt in run.attempts:
        why = (attempt.failure_reason or attempt.trigger_note or attempt.pending_reason).partition("\n")[0]
        exit_code = "" if attempt.exit_code is None else str(attempt.exit_code)
        attempts.add_row(
            str(attempt.number), attempt.state, attempt.trigger, str(attempt.world_size), layout_of(attempt.parallel),
            exit_code, why,
        )  # fmt: skip
    console.print(attempts)


@run_app.command()
@reports_errors
def cancel(run_id: RunId):
    """Cancel a run: at once while queued, else its ranks are stopped."""
    with connected() as client:
        run = client.cancel(run_id)
    typer.echo(f"run {run.id} ({run.name}): {run.state}")


Tags = Annotated[list[str], typer.Argument(help="tags: letters, digits and . _ : / - (kept in lower case)")]


@run_app.command()
@reports_errors
def tag(run_id: RunId, tags: Tags):
    """Add tags to a run, to find it by with `loom runs --tag`."""
    with connected() as client:
        run = client.tag(run_id, *tags)
    typer.echo(f"run {run.id} ({run.name}): tags {', '.join(run.tags) or 'none'}")


@run_app.command()
@reports_errors
def untag(run_id: RunId, tags: Tags):
    """Take tags off a run."""
    with connected() as client:
        run = client.untag(run_id, *tags)
    typer.echo(f"run {run.id} ({run.name}): tags {', '.join(run.tags) or 'none'}")


@run_app.command()
@reports_errors
def note(run_id: RunId, text: Annotated[str, typer.Argument(help="the note; an empty one clears it")]):
    """Write a run's note (it replaces the one it had)."""
    with connected() as client:
        run = client.edit(run_id, note=text)
    typer.echo(f"run {run.id} ({run.name}): note {'written' if run.note else 'cleared'}")


@run_app.command()
@reports_errors
def rename(run_id: RunId, name: Annotated[str, typer.Argument(help="the run's new name")]):
    """Give a run another name."""
    with connected() as client:
        run = client.edit(run_id, name=name)
    typer.echo(f"run {run.id}: renamed {run.name}")


@run_app.command()
@reports_errors
def archive(run_id: RunId):
    """Take a run out of the run list; it keeps everything (`loom runs --archived` lists it)."""
    with connected() as client:
        run = client.edit(run_id, archived=True)
    typer.echo(f"run {run.id} ({run.name}): archived")


@run_app.command()
@reports_errors
def unarchive(run_id: RunId):
    """Bring an archived run back into the run list."""
    with connected() as client:
        run = client.edit(run_id, archived=False)
    typer.echo(f"run {run.id} ({run.name}): back in the run list")


@run_app.command()
@reports_errors
def clone(
    run_id: RunId,
    name: Annotated[str | None, typer.Option(help="the new run's name")] = None,
    changes: Changes = None,
):
    """Submit a run's config again as a new run, with --set changes."""
    overrides = parse_overrides(changes or [])
    with connected() as client:
        run = client.clone(run_id, name, overrides)
    typer.echo(f"run {run.id} ({run.name}): {run.state}")


@run_app.command()
@reports_errors
def watch(run_id: RunId):
    """Follow a run live until it ends; the status is its outcome: 0 succeeded, 1 failed, 3 cancelled."""
    with connected() as client:
        raise typer.Exit(watch_to_the_end(client, run_id))


def watch_to_the_end(client: LoomClient, run_id: int) -> int:
    run = client.run(run_id)
    view = WatchView(run)
    with Live(view, console=console, auto_refresh=False) as live:
        after = max(0, run.last_seq - HISTORY_EVENTS)
        if not run.finished:
            looked = time.monotonic()
            for batch in client.watch(run_id, after=after):
                view.add(batch)
                # A state event may end the run, and a quiet spell may hide an end whose event the channel lost.
                if (
                    not batch
                    or any(event.kind == "state" for event in batch)
                    or time.monotonic() - looked > LOOK_EVERY_S
                ):
                    view.run, view.alerts, looked = client.run(run_id), client.alerts(run_id), time.monotonic()
                live.update(view, refresh=True)
                if view.run.finished:
                    break
            after = view.last_seq
        # What was stored up to the end: the last steps may come after the state event that ended the run.
        view.add(client.caught_up(run_id, after)[0])
        view.run, view.alerts = client.run(run_id), client.alerts(run_id)
        live.update(view, refresh=True)
    return OUTCOMES[view.run.state]


@app.command()
@reports_errors
def logs(
    run_id: RunId,
    attempt: Annotated[int | None, typer.Option(help="the attempt's number (default: the latest)")] = None,
    rank: Annotated[int, typer.Option(help="the global rank")] = 0,
    lines: Annotated[int, typer.Option(help="how many of the last lines")] = 200,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="print new lines until the attempt ends")] = False,
):
    """What a rank printed: its stdout on stdout, its stderr on stderr."""
    with connected() as client:
        run = client.run(run_id)
        number = attempt if attempt is not None else run.latest_attempt.number
        shown: dict[str, list[str]] = {}
        while True:
            ended = attempt_ended(client.run(run_id), number)
            tail = client.log(run_id, number, rank, lines)
            for file, tail_lines in tail.files.items():
                for line in new_lines(shown.get(file, []), tail_lines):
                    typer.echo(line, err=file.startswith("stderr"))
                shown[file] = tail_lines
            if not follow or ended:
                return
            time.sleep(FOLLOW_INTERVAL_S)


def attempt_ended(run: RunDetail, number: int) -> bool:
    attempt = next((attempt for attempt in run.attempts if attempt.number == number), None)
    return attempt is None or attempt.finished


def new_lines(before: list[str], after: list[str]) -> list[str]:
    """The lines of a file's tail that its previous tail did not show: those after the longest end of `before`
    that `after` starts with."""
    for overlap in range(min(len(before), len(after)), 0, -1):
        if before[-overlap:] == after[:overlap]:
            return after[overlap:]
    return after


@app.command()
@reports_errors
def checkpoints(run_id: RunId):
    """A run's checkpoints: step, attempt, state, layout, loss, size and what pins it."""
    with connected() as client:
        found = client.checkpoints(run_id)
    table = Table("step", "attempt", "state", "layout", "loss", "MiB", "pinned by")
    for checkpoint in found:
        loss = "" if checkpoint.loss is None else f"{checkpoint.loss:.4f}"
        table.add_row(
            str(checkpoint.step), str(checkpoint.attempt), checkpoint.state, layout_of(checkpoint.layout), loss,
            f"{checkpoint.bytes / 2**20:,.1f}", "; ".join(pin.removeprefix("pinned by ") for pin in checkpoint.pins),
        )  # fmt: skip
    console.print(table)


# What a restore can change (POST /api/runs/{id}/restore): the layout, the last step and the peak learning rate.
RESTORE_FIELDS = {"steps": "steps", "optimizer.lr": "lr"}


def restore_changes(overrides: dict[str, Any]) -> dict[str, Any]:
    """--set paths as the restore API's fields: parallel.tp=2 → {"parallel": {"tp": 2}}."""
    changes: dict[str, Any] = {}
    for path, value in overrides.items():
        section, _, field = path.partition(".")
        if section == "parallel" and field and "." not in field:
            changes.setdefault("parallel", {})[field] = value
        elif path in RESTORE_FIELDS:
            changes[RESTORE_FIELDS[path]] = value
        else:
            raise DocumentError(f"--set {path}: a restore changes parallel.<field>, steps and optimizer.lr only")
    return changes


@app.command()
@reports_errors
def restore(
    run_id: RunId,
    step: Annotated[int, typer.Option(help="the step of the committed checkpoint to start from")],
    changes: Changes = None,
    fork: Annotated[
        bool, typer.Option(help="as a new run forked from the checkpoint, not this run's next attempt")
    ] = False,
    name: Annotated[str | None, typer.Option(help="the fork's name")] = None,
):
    """Resume a run from a committed checkpoint, in another layout with --set parallel.<field>=N."""
    restore_fields = restore_changes(parse_overrides(changes or []))
    with connected() as client:
        committed = [checkpoint for checkpoint in client.checkpoints(run_id) if checkpoint.state == "committed"]
        at_step = [checkpoint for checkpoint in committed if checkpoint.step == step]
        if not at_step:
            steps = ", ".join(str(checkpoint.step) for checkpoint in committed) or "none"
            raise typer.BadParameter(f"run {run_id} has no committed checkpoint at step {step} (committed: {steps})",
                                     param_hint="--step")  # fmt: skip
        restored = client.restore(run_id, at_step[-1].id, fork=fork, name=name, **restore_fields)
    what = f"new run {restored.run}" if restored.forked else f"run {restored.run}"
    typer.echo(f"{what}: attempt {restored.attempt} queued from step {step}")


@config_app.command("get")
@reports_errors
def config_get(run_id: RunId):
    """The run's config as YAML (every default filled in); `loom run submit` takes it back unchanged."""
    with connected() as client:
        config = client.config(run_id)
    typer.echo(yaml.safe_dump(config, sort_keys=True), nl=False)


def layout_of(parallel: dict[str, Any]) -> str:
    """The degrees above 1, such as "dp_shard 2, tp 2"."""
    degrees = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
    shown = [
        f"{name} {parallel[name]}" for name in degrees if isinstance(parallel.get(name), int) and parallel[name] > 1
    ]
    return ", ".join(shown) or "1 rank"
