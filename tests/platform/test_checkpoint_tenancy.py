"""Paths belong to the platform: a config cannot name where checkpoints go or a path to resume from, resuming
names a checkpoint of the caller's own, and an attempt's checkpoint events change only its own run's rows."""

import hashlib
import json
import logging
from pathlib import Path

import pytest
from django.test import Client

from loom.checkpoints.models import COMMITTED, Checkpoint
from loom.runs import states
from loom.runs.launcher import claim_attempt, trainer_config, work_dir_for
from loom.runs.models import Attempt, Run
from loom.runs.services import create_run

from ..conftest import wait_for
from .helpers import TINY_CONFIG, BatchSender, checkpoint_event, claimed_run, own_checkpoint
from .test_api import api

pytestmark = pytest.mark.django_db

CHECKPOINTED = {**TINY_CONFIG, "checkpoint": {"interval_steps": 10}}
STEPS = (10, 20, 30)


def committed(step, path, **payload):
    return checkpoint_event("committed", step, path, bytes=100, world_size=2, **payload)


def write_checkpoint(path: Path, step: int) -> None:
    """A committed checkpoint's files as the trainer leaves them: shards and a manifest."""
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"metadata of step %d" % step)
    (path / "__0_0.distcp").write_bytes(b"weights of step %d" % step)
    (path / "manifest.json").write_text(json.dumps({"step": step, "files": []}))


def fingerprint(directory: Path) -> dict[str, str]:
    """Every file under the directory with its sha256 and modification time."""
    return {
        str(path.relative_to(directory)): f"{hashlib.sha256(path.read_bytes()).hexdigest()} {path.stat().st_mtime_ns}"
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def rows_of(run: Run) -> list[tuple]:
    return list(run.checkpoints.order_by("step").values_list("step", "state", "problem", "path"))


@pytest.fixture
def victim(platform_user, runs_dir):
    """Ada's run with an attempt that committed steps 10, 20 and 30, on disk in its own checkpoint directory.
    Returns (run, attempt, checkpoint directory)."""
    run, attempt, _ = claimed_run(platform_user[0], "ada's run", CHECKPOINTED)
    for step in STEPS:
        write_checkpoint(Path(own_checkpoint(attempt, step)), step)
    BatchSender(attempt).send(0, *(committed(step, own_checkpoint(attempt, step)) for step in STEPS))
    assert [row[:2] for row in rows_of(run)] == [(step, COMMITTED) for step in STEPS]
    return run, attempt, Path(own_checkpoint(attempt, 10)).parent


def test_a_config_naming_another_users_attempt_directory_is_refused_and_theirs_stay_untouched(
    victim, other_user, token_for, client
):
    run, _, directory = victim
    files, rows = fingerprint(directory), rows_of(run)
    counts = (Run.objects.count(), Attempt.objects.count(), Checkpoint.objects.count())
    hostile = {
        **CHECKPOINTED,
        "checkpoint": {"interval_steps": 1, "keep_last": 1, "directory": str(directory), "resume": str(directory)},
    }
    response = api(client, "post", "/api/runs", token_for(other_user), {"name": "mallory's", "config": hostile})
    assert response.status_code == 400
    errors = response.json()["errors"]
    assert set(errors) == {"config.checkpoint.directory", "config.checkpoint.resume"}
    assert errors["config.checkpoint.directory"].startswith("is chosen by the platform")
    assert errors["config.checkpoint.resume"].startswith("cannot be a path: the platform places checkpoints")
    # Nothing was stored, so nothing was launched to read or retire Ada's checkpoints.
    assert (Run.objects.count(), Attempt.objects.count(), Checkpoint.objects.count()) == counts
    assert fingerprint(directory) == files and rows_of(run) == rows


@pytest.mark.parametrize(
    "checkpoint, field",
    [
        ({"directory": "/tmp/mine"}, "config.checkpoint.directory"),
        ({"resume": "/tmp/mine/step-000010"}, "config.checkpoint.resume"),
        ({"resume": "../run-1/attempt-1/checkpoints"}, "config.checkpoint.resume"),
        ({"resume": "checkpoint:ten"}, "config.checkpoint.resume"),
    ],
)
def test_even_a_path_of_ones_own_is_refused_with_a_field_error(platform_user, token_for, client, checkpoint, field):
    config = {**TINY_CONFIG, "checkpoint": checkpoint}
    response = api(client, "post", "/api/runs", token_for(platform_user[0]), {"name": "own paths", "config": config})
    assert response.status_code == 400 and set(response.json()["errors"]) == {field}
    assert not Run.objects.exists()


def test_resuming_from_another_users_checkpoint_reads_like_a_missing_one(victim, other_user, token_for, client):
    run, _, directory = victim
    theirs = run.checkpoints.get(step=20)
    missing_id = Checkpoint.objects.order_by("-id").first().pk + 1000
    token = token_for(other_user)

    def refusal(reference):
        config = {**TINY_CONFIG, "checkpoint": {"resume": reference}}
        response = api(client, "post", "/api/runs", token, {"name": "mallory's", "config": config})
        assert response.status_code == 400
        return response.json()["errors"]

    assert refusal(f"checkpoint:{theirs.pk}") == {"config.checkpoint.resume": f"you have no checkpoint {theirs.pk}"}
    assert refusal(f"checkpoint:{missing_id}") == {"config.checkpoint.resume": f"you have no checkpoint {missing_id}"}
    no_step = "you have no run {} with a committed checkpoint at step 20"
    assert refusal(f"run:{run.pk}/step:20") == {"config.checkpoint.resume": no_step.format(run.pk)}
    assert refusal("run:999999/step:20") == {"config.checkpoint.resume": no_step.format(999999)}
    assert not Run.objects.filter(owner=other_user).exists()


def test_resuming_by_reference_stores_the_path_of_ones_own_committed_checkpoint(victim, platform_user):
    run, attempt, _ = victim
    user = platform_user[0]

    def resuming(reference):
        return {**TINY_CONFIG, "checkpoint": {"resume": reference}}

    by_id = create_run(user, "by id", resuming(f"checkpoint:{run.checkpoints.get(step=20).pk}"))
    by_step = create_run(user, "by step", resuming(f"run:{run.pk}/step:30"))
    latest = create_run(user, "latest", resuming("latest"))
    assert by_id.config["checkpoint"]["resume"] == own_checkpoint(attempt, 20)
    assert by_id.attempts.get().config["checkpoint"]["resume"] == own_checkpoint(attempt, 20)
    assert by_step.config["checkpoint"]["resume"] == own_checkpoint(attempt, 30)
    assert latest.config["checkpoint"]["resume"] == "latest"
    # Each resumes from the run it names: a fork of it, in its lineage from the start.
    by_id_first, latest_first = by_id.attempts.get(), latest.attempts.get()
    assert (by_id.forked_from.step, by_id_first.restored_from.step) == (20, 20)
    assert (by_step.forked_from.step, by_step.attempts.get().restored_from.step) == (30, 30)
    assert (latest.forked_from, latest_first.restored_from) == (None, None)
    queued = by_id.events.get(kind="state", payload__state="queued").payload
    assert (queued["checkpoint"], queued["step"]) == (by_id.forked_from.pk, 20)
    # Retention took step 10 away: it is no longer there to resume from.
    BatchSender(attempt).send(1, checkpoint_event("deleted", 10, own_checkpoint(attempt, 10)))
    gone = run.checkpoints.get(step=10)
    client = Client()
    client.force_login(user)
    for reference, message in [
        (
            f"checkpoint:{gone.pk}",
            f"checkpoint {gone.pk} is deleted (deleted by {attempt} (retention)); choose a committed one",
        ),
        (f"run:{run.pk}/step:10", f"you have no run {run.pk} with a committed checkpoint at step 10"),
    ]:
        body = {"name": "from a deleted one", "config": resuming(reference)}
        response = api(client, "post", "/api/runs", None, body)
        assert response.status_code == 400
        assert response.json() == {"errors": {"config.checkpoint.resume": message}}
    assert Run.objects.filter(owner=user).count() == 4


def test_an_attempts_events_naming_another_runs_checkpoints_change_nothing_there(victim, other_user, caplog):
    run, attempt, directory = victim
    _, intruder, _ = claimed_run(other_user, "mallory's", CHECKPOINTED)
    rows = rows_of(run)
    step10, step20, step30 = (own_checkpoint(attempt, step) for step in STEPS)
    with caplog.at_level(logging.WARNING, logger="loom.checkpoints.services"):
        BatchSender(intruder).send(
            0,
            committed(10, step10),
            checkpoint_event("corrupt", 20, step20, error="__0_0.distcp: sha256 mismatch"),
            checkpoint_event("deleted", 30, step30),
            checkpoint_event("loaded", 30, step30),
            committed(40, own_checkpoint(intruder, 40), parent=step30),
        )
    assert rows_of(run) == rows
    # Its own commit is recorded; the parent it named is someone else's, so it has none.
    (own,) = Checkpoint.objects.filter(run=intruder.run)
    assert (own.step, own.path, own.parent) == (40, own_checkpoint(intruder, 40), None)
    intruder.refresh_from_db()
    assert intruder.restored_from is None
    warned = [record.getMessage() for record in caplog.records]
    assert any(f"reported committing {step10}, outside its checkpoint directory" in line for line in warned)
    assert any(f"reported corrupt {step20}, a checkpoint of another run" in line for line in warned)
    assert any(f"reported deleted {step30}, a checkpoint of another run" in line for line in warned)
    assert any(f"reported loading {step30}, which is no checkpoint of its owner's" in line for line in warned)
    # The events themselves are stored as sent: the record of what the attempt claimed.
    assert intruder.run.events.filter(kind="checkpoint").count() == 5


def test_corrupt_and_deleted_reports_mark_only_the_reporting_attempts_run_even_for_the_same_owner(
    victim, platform_user
):
    run, attempt, _ = victim
    step20, step30 = run.checkpoints.get(step=20), run.checkpoints.get(step=30)
    damaged = checkpoint_event("corrupt", 20, step20.path, error="__0_0.distcp: sha256 mismatch")
    retired = checkpoint_event("deleted", 30, step30.path)
    neighbour = claimed_run(platform_user[0], "neighbour", CHECKPOINTED)[1]
    BatchSender(neighbour).send(0, damaged, retired)
    assert [row[:2] for row in rows_of(run)] == [(step, COMMITTED) for step in STEPS]
    # A restart of the run reports what it found in its previous attempt's directory.
    restart = Attempt.objects.create(run=run, number=2, config=attempt.config, trigger=Attempt.RESTART)
    BatchSender(restart).send(0, damaged, retired)
    step20.refresh_from_db()
    step30.refresh_from_db()
    assert (step20.state, step20.problem) == ("corrupt", "__0_0.distcp: sha256 mismatch")
    assert step30.state == "deleted"


def test_the_launcher_places_checkpoints_in_the_attempts_own_directory_whatever_the_stored_config_says(
    platform_user, runs_dir
):
    run = create_run(platform_user[0], "stored before directories were refused", TINY_CONFIG)
    legacy = {**run.config, "checkpoint": {**run.config["checkpoint"], "directory": "/elsewhere/checkpoints"}}
    Attempt.objects.filter(run=run).update(config=legacy)
    attempt, _ = claim_attempt(run.attempts.get().pk)
    assert attempt.work_dir == str(work_dir_for(attempt)) == str(runs_dir / f"run-{run.pk}" / "attempt-1")
    config = trainer_config(attempt, work_dir_for(attempt))
    assert config["checkpoint"]["directory"] == str(runs_dir / f"run-{run.pk}" / "attempt-1" / "checkpoints")
    assert {key: value for key, value in config.items() if key != "checkpoint"} == {
        key: value for key, value in legacy.items() if key != "checkpoint"
    }


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_run_resumes_from_ones_own_checkpoint_by_id_and_leaves_it_on_disk(live_platform, platform_user):
    """A real run trains 10 steps saving every 5; a second run resumes from its step 5 by id, trains 6-10 with
    the first run's losses, and its retention (keep_last 1) leaves the first run's checkpoints alone."""
    user = platform_user[0]
    config = {**TINY_CONFIG, "steps": 10, "checkpoint": {"interval_steps": 5}}
    first = create_run(user, "first", config)
    wait_for(lambda: Run.objects.get(pk=first.pk).state in states.TERMINAL, timeout=300, message="the first run")
    step5 = Checkpoint.objects.get(run=first, step=5)
    assert Run.objects.get(pk=first.pk).state == states.SUCCEEDED
    resumed_config = {**config, "checkpoint": {"interval_steps": 5, "keep_last": 1, "resume": f"checkpoint:{step5.pk}"}}
    second = create_run(user, "second", resumed_config)
    wait_for(lambda: Run.objects.get(pk=second.pk).state in states.TERMINAL, timeout=300, message="the second run")
    attempt = second.attempts.get()
    assert attempt.state == states.SUCCEEDED, attempt.failure_reason
    assert attempt.restored_from == step5
    assert second.events.get(kind="checkpoint", payload__state="loaded").step == 5
    losses = {
        run.pk: {event.step: event.payload["loss_mean"] for event in run.events.filter(kind="metric", rank=0)}
        for run in (first, second)
    }
    assert sorted(losses[second.pk]) == list(range(6, 11))
    for step, loss in losses[second.pk].items():
        assert loss == pytest.approx(losses[first.pk][step], rel=1e-5), step
    (own,) = Checkpoint.objects.filter(run=second)
    assert own.path == own_checkpoint(attempt, 10) and own.parent == step5
    step5.refresh_from_db()
    assert step5.state == COMMITTED and Path(step5.path, "manifest.json").is_file()
