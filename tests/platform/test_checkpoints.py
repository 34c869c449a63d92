"""Checkpoint rows from ingested events, the restart policy, restores through the API, resilience figures."""

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from loom.checkpoints import services
from loom.checkpoints.models import Checkpoint, Pin
from loom.checkpoints.resilience import resilience, young_daly_interval_s
from loom.runs import states
from loom.runs.launcher import work_dir_for
from loom.runs.lifecycle import restarts_in_a_row
from loom.runs.models import Attempt, Run

from ..conftest import wait_for
from .helpers import TINY_CONFIG, BatchSender, checkpoint_event, claimed_run, own_checkpoint

pytestmark = pytest.mark.django_db

LAYOUT = {"dp_replicate": 2, "dp_shard": 1, "tp": 1, "pp": 1, "cp": 1}


def as_launched(attempt, token_hash):
    """A later attempt given a token and its work dir, as the launcher's claim gives them."""
    Attempt.objects.filter(pk=attempt.pk).update(token_hash=token_hash, work_dir=str(work_dir_for(attempt)))
    attempt.refresh_from_db()


def committed(step, path, parent=None, time=100.0, stall_s=0.05):
    return checkpoint_event(
        "committed", step, path, time, bytes=1000 + step, layout=LAYOUT, world_size=2, parent=parent,
        stall_s=stall_s, save_s=0.5, loss=5.0 - step / 10,
    )  # fmt: skip


class Ranks(BatchSender):
    """An attempt's ranks and launcher, with the histories these tests need."""

    def metrics(self, steps, start_time, step_time_s=1.0):
        for step in steps:
            self.send(0, metric(step, start_time + step * step_time_s, step_time_s))

    def fail(
        self, time, kind="killed", retryable=True, reason="torchrun exited with code 1\nrank 1 was killed by SIGKILL"
    ):
        self.send(-1, state(states.STARTING, time - 50), state(states.RUNNING, time - 49))
        final = {"state": states.FAILED, "exit_code": 1, "reason": reason, "failure_kind": kind, "retryable": retryable}
        self.send(-1, {"kind": "state", "time": time, "payload": final})


def metric(step, time, step_time_s=1.0):
    return {
        "kind": "metric",
        "time": time,
        "step": step,
        "payload": {"loss_mean": 5.0 - step / 10, "step_time_s": step_time_s},
    }


def state(name, time):
    return {"kind": "state", "time": time, "payload": {"state": name}}


def test_committed_events_become_checkpoints_linked_to_their_parents(platform_user):
    run, attempt, _ = claimed_run(platform_user[0])
    ranks = Ranks(attempt)
    ranks.send(
        0,
        committed(5, own_checkpoint(attempt, 5)),
        committed(10, own_checkpoint(attempt, 10), parent=own_checkpoint(attempt, 5)),
    )
    first, second = Checkpoint.objects.filter(run=run).order_by("step")
    assert (first.step, first.state, first.bytes, first.world_size, first.layout) == (5, "committed", 1005, 2, LAYOUT)
    assert (second.parent, second.stall_s, second.loss) == (first, 0.05, 4.0)
    ranks.send(0, checkpoint_event("deleted", 5, own_checkpoint(attempt, 5)))
    ranks.send(
        0,
        checkpoint_event("corrupt", 10, own_checkpoint(attempt, 10), error="step-000010/__0_0.distcp: sha256 mismatch"),
    )
    first.refresh_from_db()
    second.refresh_from_db()
    assert first.state == "deleted"
    assert (second.state, second.problem) == ("corrupt", "step-000010/__0_0.distcp: sha256 mismatch")
    assert run.events.filter(kind="checkpoint").count() == 4  # the events themselves are kept too


def test_a_save_under_the_same_name_marks_the_older_one_deleted(platform_user):
    run, attempt, _ = claimed_run(platform_user[0])
    ranks = Ranks(attempt)
    ranks.send(0, committed(5, own_checkpoint(attempt, 5)), committed(5, own_checkpoint(attempt, 5), time=200.0))
    assert list(Checkpoint.objects.filter(run=run).order_by("id").values_list("state", flat=True)) == [
        "deleted",
        "committed",
    ]


def test_a_loaded_event_records_where_the_attempt_started(platform_user):
    run, attempt, _ = claimed_run(platform_user[0])
    Ranks(attempt).send(0, committed(5, own_checkpoint(attempt, 5)))
    other_run, other_attempt, _ = claimed_run(platform_user[0], "second")
    Ranks(other_attempt).send(0, checkpoint_event("loaded", 5, own_checkpoint(attempt, 5), layout=LAYOUT, world_size=2))
    other_attempt.refresh_from_db()
    assert other_attempt.restored_from == Checkpoint.objects.get(run=run)


def test_a_retryable_failure_restarts_from_the_failed_attempts_checkpoints_without_its_faults(platform_user):
    config = {**TINY_CONFIG, "checkpoint": {"interval_steps": 5}, "faults": {"kill_at_step": 7, "kill_rank": 1}}
    run, attempt, _ = claimed_run(platform_user[0], config=config)
    ranks = Ranks(attempt)
    ranks.send(0, committed(5, own_checkpoint(attempt, 5)))
    ranks.fail(time=1000.0)
    attempt.refresh_from_db()
    run.refresh_from_db()
    restart = run.attempts.get(number=2)
    assert (attempt.state, attempt.failure_kind, attempt.retryable) == (states.FAILED, "killed", True)
    assert attempt.restart_decision.startswith("restarted as attempt 2 from its checkpoints (newest: step 5)")
    assert (restart.state, restart.trigger, run.state) == (states.QUEUED, Attempt.RESTART, states.QUEUED)
    assert restart.restored_from == Checkpoint.objects.get(run=run, step=5)
    assert restart.config["checkpoint"]["resume"] == str(Path(own_checkpoint(attempt, 5)).parent)
    assert restart.config["faults"]["kill_at_step"] is None  # the rehearsed failure happens once
    assert "automatic restart 1 of 3" in restart.trigger_note and "rank 1 was killed by SIGKILL" in restart.trigger_note
    queued = run.events.filter(kind="state", attempt=restart).get()
    assert queued.payload["trigger"] == "restart" and queued.payload["step"] == 5


@pytest.mark.parametrize(
    "kind, decision",
    [
        ("out_of_memory", "not restarted: a failure of kind 'out of memory' would happen again"),
        ("invalid_config", "not restarted: a failure of kind 'invalid config' would happen again"),
        ("exception", "not restarted: a failure of kind 'exception' would happen again"),
    ],
)
def test_failures_that_would_repeat_are_not_restarted(platform_user, kind, decision):
    run, attempt, _ = claimed_run(platform_user[0])
    Ranks(attempt).fail(time=1000.0, kind=kind, retryable=False, reason="Traceback …")
    attempt.refresh_from_db()
    run.refresh_from_db()
    assert attempt.restart_decision == decision
    assert run.attempts.count() == 1 and run.state == states.FAILED


def test_restarts_stop_after_max_restarts_in_a_row(platform_user):
    config = {**TINY_CONFIG, "restart": {"max_restarts": 2}}
    run, attempt, _ = claimed_run(platform_user[0], config=config)
    for number in (1, 2, 3):
        current = run.attempts.get(number=number)
        if number > 1:  # the launcher claims each restart as it would the first attempt
            Attempt.objects.filter(pk=current.pk).update(token_hash=f"restart-{number}")
            current.refresh_from_db()
        Ranks(current).fail(time=1000.0 * number)
    run.refresh_from_db()
    assert run.attempts.count() == 3 and run.state == states.FAILED
    last = run.attempts.get(number=3)
    assert restarts_in_a_row(last) == 2
    assert last.restart_decision == "not restarted: 2 of 2 automatic restarts used (restart.max_restarts)"


def test_a_restart_without_checkpoints_resumes_where_the_attempt_had_started(platform_user):
    run, attempt, _ = claimed_run(platform_user[0], config={**TINY_CONFIG, "checkpoint": {"interval_steps": 5}})
    Ranks(attempt).send(0, committed(5, own_checkpoint(attempt, 5)))
    source = Checkpoint.objects.get(run=run)
    restored = api_restore(run, {"checkpoint": source.pk}, platform_user)
    assert restored.status_code == 400  # attempt 1 is still active
    Ranks(attempt).fail(time=500.0, kind="exception", retryable=False)
    second = run.attempts.get(number=api_restore(run, {"checkpoint": source.pk}, platform_user).json()["attempt"])
    Attempt.objects.filter(pk=second.pk).update(token_hash="second")
    second.refresh_from_db()
    Ranks(second).fail(time=900.0)
    third = run.attempts.get(number=3)
    assert third.config["checkpoint"]["resume"] == own_checkpoint(attempt, 5)
    assert third.restored_from == source and "where it had started" in third.trigger_note


# Restoring through the API.


@pytest.fixture
def finished_with_checkpoints(platform_user):
    config = {**TINY_CONFIG, "checkpoint": {"interval_steps": 5}}
    run, attempt, _ = claimed_run(platform_user[0], config=config)
    ranks = Ranks(attempt)
    ranks.send(
        0,
        committed(5, own_checkpoint(attempt, 5)),
        committed(10, own_checkpoint(attempt, 10), parent=own_checkpoint(attempt, 5)),
    )
    ranks.send(
        0, checkpoint_event("corrupt", 10, own_checkpoint(attempt, 10), error="step-000010/__1_0.distcp: missing")
    )
    ranks.send(-1, state(states.STARTING, 1.0), state(states.RUNNING, 2.0), state(states.SUCCEEDED, 3.0))
    run.refresh_from_db()
    return run


def api_restore(run, body, platform_user):
    from django.test import Client

    client = Client()
    client.force_login(platform_user[0])
    return client.post(f"/api/runs/{run.pk}/restore", data=json.dumps(body), content_type="application/json")


@pytest.mark.parametrize(
    "body, errors",
    [
        ({}, {"checkpoint": "is required: the id of one of this run's committed checkpoints"}),
        ({"checkpoint": 999999}, {"checkpoint": "no such"}),
        ({"checkpoint": "step10"}, {"checkpoint": "is required"}),
        ({"checkpoint": "STEP5", "mode": "sideways"}, {"mode": "must be one of attempt, fork"}),
        (
            {"checkpoint": "STEP10"},
            {"checkpoint": "is corrupt (step-000010/__1_0.distcp: missing); choose a committed one"},
        ),
        (
            {"checkpoint": "STEP5", "parallel": {"tp": 3}},
            {"config.parallel.tp": "heads", "config.model.seq_len": "tp"},
        ),
        ({"checkpoint": "STEP5", "parallel": "tp2"}, {"config.parallel": "must be an object"}),
        ({"checkpoint": "STEP5", "mode": "fork", "name": "  "}, {"name": "must not be blank"}),
        ({"checkpoint": "STEP5", "lr": 0}, {"config.optimizer.lr": "greater than 0"}),
        ({"checkpoint": "STEP5", "skip_steps": [9, 6]}, {"config.data.skip_steps": "1 <= first <= last"}),
    ],
)
def test_bad_restores_get_field_errors_and_change_nothing(finished_with_checkpoints, platform_user, body, errors):
    run = finished_with_checkpoints
    ids = {f"STEP{c.step}": c.pk for c in run.checkpoints.all()}
    body = {key: ids.get(value, value) if isinstance(value, str) else value for key, value in body.items()}
    if body.get("checkpoint") == 999999:
        errors = {"checkpoint": f"run {run.pk} has no checkpoint 999999"}
    counts = (Run.objects.count(), Attempt.objects.count(), run.events.count())
    response = api_restore(run, body, platform_user)
    assert response.status_code == 400
    got = response.json()["errors"]
    assert set(got) == set(errors)
    for field, message in errors.items():
        assert message in got[field], got
    assert (Run.objects.count(), Attempt.objects.count(), run.events.count()) == counts


def test_restore_as_a_new_attempt_in_another_layout(finished_with_checkpoints, platform_user):
    run = finished_with_checkpoints
    step5 = run.checkpoints.get(step=5)
    response = api_restore(run, {"checkpoint": step5.pk, "parallel": {"dp_replicate": 1, "tp": 2}}, platform_user)
    assert response.status_code == 201, response.json()
    assert response.json() == {"run": run.pk, "attempt": 2, "forked": False}
    attempt = run.attempts.get(number=2)
    assert (attempt.config["parallel"]["tp"], attempt.config["parallel"]["dp_replicate"]) == (2, 1)
    assert attempt.config["checkpoint"]["resume"] == step5.path
    assert (attempt.trigger, attempt.restored_from, attempt.state) == (Attempt.RESTORE, step5, states.QUEUED)
    run.refresh_from_db()
    assert run.state == states.QUEUED
    assert run.config["parallel"]["dp_replicate"] == 2  # the run keeps what it was created with


def test_restore_past_a_loss_spike_skips_its_data_and_lowers_the_learning_rate(
    finished_with_checkpoints, platform_user
):
    run = finished_with_checkpoints
    step5 = run.checkpoints.get(step=5)
    response = api_restore(run, {"checkpoint": step5.pk, "lr": 0.001, "skip_steps": [6, 9]}, platform_user)
    assert response.status_code == 201, response.json()
    config = run.attempts.get(number=2).config
    assert (config["optimizer"]["lr"], config["data"]["skip_steps"]) == (0.001, [[6, 9]])


def test_fork_creates_a_run_whose_lineage_joins_the_original(finished_with_checkpoints, platform_user, other_user):
    run = finished_with_checkpoints
    step5 = run.checkpoints.get(step=5)
    response = api_restore(run, {"checkpoint": step5.pk, "mode": "fork", "steps": 40}, platform_user)
    assert response.status_code == 201
    fork = Run.objects.get(pk=response.json()["run"])
    assert (fork.forked_from, fork.name, fork.config["steps"]) == (step5, f"{run.name} from step 5", 40)
    assert fork.attempts.get().restored_from == step5
    from django.test import Client

    client = Client()
    client.force_login(platform_user[0])
    for origin in (run, fork):
        lineage = client.get(f"/api/runs/{origin.pk}/lineage").json()
        assert [r["id"] for r in lineage["runs"]] == [run.pk, fork.pk]
        assert {(a["run"], a["number"], a["restored_from"]) for a in lineage["attempts"]} == {
            (run.pk, 1, None),
            (fork.pk, 1, step5.pk),
        }
        assert [(c["step"], c["state"]) for c in lineage["checkpoints"]] == [(5, "committed"), (10, "corrupt")]
    checkpoints = client.get(f"/api/runs/{run.pk}/checkpoints").json()
    assert [(c["step"], c["attempt"], c["parent"]) for c in checkpoints] == [(5, 1, None), (10, 1, step5.pk)]
    stranger = Client()
    stranger.force_login(other_user)
    assert stranger.get(f"/api/runs/{run.pk}/lineage").status_code == 404
    assert api_restore(run, {"checkpoint": step5.pk, "mode": "fork"}, (other_user,)).status_code == 404


# Resilience figures.


def test_resilience_figures_from_a_failure_and_its_restart(platform_user):
    run, attempt, _ = claimed_run(platform_user[0], config={**TINY_CONFIG, "checkpoint": {"interval_steps": 5}})
    start = datetime(2026, 1, 1, tzinfo=UTC).timestamp()
    ranks = Ranks(attempt)
    ranks.metrics(range(1, 8), start)  # steps 1–7 at start+1 … start+7, 1 s each
    ranks.send(0, committed(5, own_checkpoint(attempt, 5), time=start + 5, stall_s=0.2))
    ranks.fail(time=start + 8)
    failed_at = start + 8
    Attempt.objects.filter(pk=attempt.pk).update(
        started_at=datetime.fromtimestamp(start, UTC), finished_at=datetime.fromtimestamp(failed_at, UTC)
    )
    restart = run.attempts.get(number=2)
    as_launched(restart, "restart")
    restarted = Ranks(restart)
    restarted.metrics(range(6, 21), start + 6)  # the first step after resume (6) at start+12, the last at +26
    restarted.send(0, committed(10, own_checkpoint(restart, 10), time=start + 16, stall_s=0.4))
    Attempt.objects.filter(pk=restart.pk).update(
        state=states.SUCCEEDED, finished_at=datetime.fromtimestamp(start + 26, UTC)
    )
    figures = resilience(run)
    (failure,) = figures["failures"]
    assert (failure["last_step"], failure["resumed_step"], failure["rpo_steps"]) == (7, 5, 2)
    assert failure["rto_s"] == pytest.approx(12 - 8)
    assert figures["wall_s"] == pytest.approx(26)
    # Kept: steps 1–5 of attempt 1 and 6–20 of attempt 2, 1 s each; steps 6–7 of attempt 1 were lost.
    assert figures["productive_s"] == pytest.approx(20)
    assert figures["ettr"] == pytest.approx(20 / 26)
    assert figures["checkpoint_stall_s"] == {
        "saves": 2,
        "mean": pytest.approx(0.3),
        "max": 0.4,
        "total": pytest.approx(0.6),
    }
    advice = figures["young_daly"]
    assert (advice["mtbf_s"], advice["save_cost_s"]) == (pytest.approx(26), pytest.approx(0.3))
    assert advice["interval_s"] == pytest.approx(young_daly_interval_s(26, 0.3)) == pytest.approx((2 * 26 * 0.3) ** 0.5)
    assert advice["interval_steps"] == round(advice["interval_s"] / 1.0)
    assert figures["configured_interval_s"] == pytest.approx(5.0)


def test_no_young_daly_advice_before_a_failure(platform_user):
    run, attempt, _ = claimed_run(platform_user[0])
    start = datetime(2026, 1, 1, tzinfo=UTC).timestamp()
    Ranks(attempt).metrics(range(1, 4), start)
    Attempt.objects.filter(pk=attempt.pk).update(started_at=datetime.fromtimestamp(start, UTC) - timedelta(seconds=1))
    figures = resilience(run)
    assert figures["failures"] == [] and figures["young_daly"] is None
    assert figures["ettr"] == pytest.approx(3 / 4)


# The command line.


def test_the_command_lists_checkpoints_and_restores_one_into_another_layout(finished_with_checkpoints):
    from io import StringIO

    from django.core.management import CommandError, call_command

    run = finished_with_checkpoints
    out = StringIO()
    call_command("checkpoints", str(run.pk), stdout=out)
    listed = out.getvalue().splitlines()
    assert [line.split()[1] for line in listed] == ["5", "10"] and "corrupt" in listed[1]
    with pytest.raises(CommandError, match="no committed checkpoint of step 10; committed steps: 5"):
        call_command("checkpoints", str(run.pk), "--restore", "10")
    with pytest.raises(CommandError, match="config.parallel.tp: "):
        call_command("checkpoints", str(run.pk), "--restore", "5", "--set", "tp=3")
    assert run.attempts.count() == 1
    out = StringIO()
    call_command(
        "checkpoints", str(run.pk), "--restore", "5", "--set", "dp_replicate=1", "--set", "dp_shard=2", stdout=out
    )
    assert out.getvalue().startswith(f"run {run.pk} attempt 2 queued: restored from step 5")
    parallel = run.attempts.get(number=2).config["parallel"]
    assert (parallel["dp_replicate"], parallel["dp_shard"]) == (1, 2)
    out = StringIO()
    call_command("checkpoints", str(run.pk), "--restore", "5", "--fork", "--name", "wider", stdout=out)
    fork = Run.objects.get(name="wider")
    assert fork.forked_from == run.checkpoints.get(step=5) and out.getvalue().startswith(f"run {fork.pk} attempt 1")


# Pins: what retention keeps.


def test_pin_and_unpin_through_the_api_the_owners_only(finished_with_checkpoints, platform_user, other_user, token_for):
    from django.test import Client

    from .test_api import api

    run = finished_with_checkpoints
    step5, step10 = run.checkpoints.order_by("step")
    token, client = token_for(platform_user[0]), Client()
    pinned = api(client, "post", f"/api/runs/{run.pk}/checkpoints/{step5.pk}/pin", token)
    assert pinned.status_code == 200
    assert (pinned.json()["pinned"], pinned.json()["pins"]) == (True, ["pinned by ada"])
    # Pinning twice is pinning.
    assert api(client, "post", f"/api/runs/{run.pk}/checkpoints/{step5.pk}/pin", token).json()["pins"] == [
        "pinned by ada"
    ]
    listed = api(client, "get", f"/api/runs/{run.pk}/checkpoints", token).json()
    assert [(item["step"], item["pinned"], item["pins"]) for item in listed] == [
        (5, True, ["pinned by ada"]),
        (10, False, []),
    ]
    # Only a committed checkpoint can be kept.
    corrupt = api(client, "post", f"/api/runs/{run.pk}/checkpoints/{step10.pk}/pin", token)
    assert corrupt.status_code == 400
    assert corrupt.json()["errors"] == {
        "checkpoint": "is corrupt (step-000010/__1_0.distcp: missing); only a committed one can be pinned"
    }
    # Someone else's run and its checkpoints are no one's; a checkpoint of another run is not this run's.
    mallory = token_for(other_user)
    for action in ("pin", "unpin"):
        assert api(client, "post", f"/api/runs/{run.pk}/checkpoints/{step5.pk}/{action}", mallory).status_code == 404
    assert api(client, "post", f"/api/runs/{run.pk}/checkpoints/999999/pin", token).status_code == 404
    assert Pin.objects.count() == 1

    unpinned = api(client, "post", f"/api/runs/{run.pk}/checkpoints/{step5.pk}/unpin", token).json()
    assert (unpinned["pinned"], unpinned["pins"]) == (False, [])
    assert not Pin.objects.exists()


def test_a_live_alert_pins_the_checkpoint_triage_offers_until_it_is_resolved(platform_user, client):
    from loom.alerts import detectors
    from loom.alerts.detectors import Finding
    from loom.alerts.services import record, resolve

    run, attempt, token = claimed_run(platform_user[0], config={**TINY_CONFIG, "checkpoint": {"interval_steps": 10}})
    first = Ranks(attempt)
    for step in (50, 60, 70):
        first.send(0, committed(step, own_checkpoint(attempt, step)))
    first.fail(time=200.0, kind="exception", retryable=False)
    # A restored attempt wrote its own checkpoints of the same run, in its own directory.
    restored = Attempt.objects.create(run=run, number=2, config=attempt.config, trigger=Attempt.RESTORE)
    as_launched(restored, "restored")
    Ranks(restored).send(0, committed(80, own_checkpoint(restored, 80)), committed(90, own_checkpoint(restored, 90)))
    spike = Finding(detectors.LOSS_SPIKE, 70, detectors.WARNING, "loss 40 at step 70")
    slow = Finding(detectors.STRAGGLER, 95, detectors.WARNING, "rank 1 is slow", rank=1)
    loss_spike, straggler = record(restored, [spike, slow], str).opened
    pin = services.pin(platform_user[0], run, run.checkpoints.get(step=90).pk)
    assert pin.pins == [f"pinned by alert #{straggler.pk} (straggler at step 95)", "pinned by ada"]

    by_path = {
        own_checkpoint(attempt, 60): [f"pinned by alert #{loss_spike.pk} (loss spike at step 70)"],
        own_checkpoint(restored, 90): [f"pinned by alert #{straggler.pk} (straggler at step 95)", "pinned by ada"],
    }
    answer = client.get("/api/checkpoints/pinned", HTTP_AUTHORIZATION=f"Bearer {token}")
    # No metric judged yet: retention must wait for every step.
    assert answer.status_code == 200 and answer.json() == {"pinned": by_path, "judged_through": 0}
    assert client.get("/api/checkpoints/pinned", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    # Unpinning takes back the person's pin only; resolving an alert takes back its own.
    assert services.unpin(platform_user[0], run, run.checkpoints.get(step=90).pk).pins == [
        by_path[own_checkpoint(restored, 90)][0]
    ]
    resolve(loss_spike, platform_user[0])
    assert services.pinned_paths(run) == {own_checkpoint(restored, 90): [by_path[own_checkpoint(restored, 90)][0]]}


@pytest.mark.django_db(transaction=True)
def test_the_pins_answer_says_how_far_the_alerts_have_judged_and_nothing_when_they_are_off(platform_user, client):
    from loom.alerts.watch import Watcher

    run, attempt, token = claimed_run(platform_user[0])
    Ranks(attempt).send(0, *(metric(step, 100.0 + step) for step in (1, 2, 3)))
    Watcher(0.01).notice([(attempt.pk, 0, 3, {"loss": 1.0})])
    wait_for(
        lambda: Attempt.objects.get(pk=attempt.pk).alerts_judged_through == 3, timeout=30, message="a watcher pass"
    )
    answer = client.get("/api/checkpoints/pinned", HTTP_AUTHORIZATION=f"Bearer {token}").json()
    assert answer == {"pinned": {}, "judged_through": 3}
    _, quiet, quiet_token = claimed_run(
        platform_user[0], name="quiet", config={**TINY_CONFIG, "alerts": {"enabled": False}}
    )
    answer = client.get("/api/checkpoints/pinned", HTTP_AUTHORIZATION=f"Bearer {quiet_token}").json()
    assert answer == {"pinned": {}, "judged_through": None}
