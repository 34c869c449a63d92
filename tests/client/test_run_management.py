"""LoomClient.runs paging through the run list with its cursor, and the `loom runs` and `loom run tag|untag|note|
rename|archive|unarchive` commands, against the platform's WSGI application in this process (no server): the
client's requests go through httpx to the real API on the test database."""

import httpx
import pytest
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from typer.testing import CliRunner

from loom.runs.models import Run
from loom.runs.services import create_run, edit_run
from loom_client import ApiError, LoomClient, cli
from loom_client.cli import alerts_of, duration_of
from tests.platform.helpers import TINY_CONFIG

pytestmark = pytest.mark.django_db

runner = CliRunner()


@pytest.fixture
def ada(platform_user):
    return platform_user[0]


@pytest.fixture
def in_process(ada, token_for):
    """A new client whose requests the platform answers in this process, inside the test's transaction: Django
    must not close the test's connection as each request ends (the contract test does the same)."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    token, transport = token_for(ada), httpx.WSGITransport(app=WSGIHandler())
    yield lambda: LoomClient("http://testserver", token, transport=transport)
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def client(in_process):
    with in_process() as connected:
        yield connected


@pytest.fixture
def loom(in_process, monkeypatch):
    """`loom ARGS…` with each command's client answered in this process."""
    monkeypatch.setattr(cli, "connected", in_process)
    return lambda *arguments: runner.invoke(cli.app, list(arguments), env={"COLUMNS": "250"})


def test_runs_follows_the_cursor_page_after_page(client, ada, monkeypatch):
    monkeypatch.setattr("loom_client.client.RUNS_PAGE", 2)
    runs = [create_run(ada, f"run {index}", TINY_CONFIG) for index in range(5)]
    assert [run.name for run in client.runs()] == [f"run {index}" for index in (4, 3, 2, 1, 0)]
    assert [run.name for run in client.runs(limit=3)] == ["run 4", "run 3", "run 2"]
    assert [run.name for run in client.runs(sort="name", limit=1)] == ["run 0"]
    edit_run(runs[1], tags=["sweep"], note="warm-up of 2 steps")
    edit_run(runs[2], archived=True)
    assert [run.name for run in client.runs(tag="sweep")] == ["run 1"]
    assert [run.name for run in client.runs(search="WARM")] == ["run 1"]
    assert [run.name for run in client.runs(archived=True)] == ["run 2"]
    assert [run.name for run in client.runs(state=["queued", "cancelled"])] == ["run 4", "run 3", "run 1", "run 0"]
    with pytest.raises(ApiError) as refused:
        list(client.runs(state="sleeping"))
    assert refused.value.status == 400 and "unknown states ['sleeping']" in refused.value.errors["state"]


def test_tag_untag_note_rename_archive_and_unarchive_from_the_command_line(loom, ada):
    run = create_run(ada, "tiny", TINY_CONFIG)
    tagged = loom("run", "tag", str(run.pk), "Baseline", "lr:3e-4")
    assert (tagged.exit_code, tagged.stdout.strip()) == (0, f"run {run.pk} (tiny): tags baseline, lr:3e-4")
    assert loom("run", "tag", str(run.pk), "baseline").stdout.strip().endswith("tags baseline, lr:3e-4")
    refused = loom("run", "tag", str(run.pk), "no spaces")
    assert refused.exit_code == 2 and refused.stderr.startswith("tags: 'no spaces' is not a tag: a tag is 1 to 40")
    assert loom("run", "untag", str(run.pk), "lr:3e-4", "never-had").stdout.strip().endswith("tags baseline")
    assert loom("run", "note", str(run.pk), "the one to beat").stdout.strip() == f"run {run.pk} (tiny): note written"
    assert loom("run", "rename", str(run.pk), "tiny baseline").stdout.strip() == f"run {run.pk}: renamed tiny baseline"

    listed = loom("runs", "--tag", "baseline")
    assert listed.exit_code == 0, listed.output
    row = next(line for line in listed.stdout.splitlines() if f" {run.pk} " in line)
    for shown in ("tiny baseline", "queued", "dp_replicate 2", "-/20", "baseline", "the one to beat"):
        assert shown in row, row

    assert loom("run", "archive", str(run.pk)).stdout.strip() == f"run {run.pk} (tiny baseline): archived"
    assert "tiny baseline" not in loom("runs").stdout
    assert "tiny baseline" in loom("runs", "--archived").stdout
    assert loom("run", "unarchive", str(run.pk)).exit_code == 0
    stored = Run.objects.get(pk=run.pk)
    assert (stored.name, stored.note, stored.archived_at) == ("tiny baseline", "the one to beat", None)
    assert list(stored.tags.values_list("name", flat=True)) == ["baseline"]


def test_durations_and_alerts_as_the_run_list_writes_them():
    assert [duration_of(seconds) for seconds in (None, 12.7, 250, 11_100)] == ["", "12s", "4m 10s", "3h 05m"]
    assert [alerts_of(live, critical) for live, critical in ((0, 0), (2, 0), (3, 1))] == [
        "", "2 open", "3 open (1 critical)",
    ]  # fmt: skip
