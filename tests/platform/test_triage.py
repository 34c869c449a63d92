"""The triage page of a run with alerts, checkpoints and rank logs: suspects ordered, the checkpoint before
each alert offered, the logs around its step, search across every rank log; and the run list's counts."""

import time

from django.test import Client

from loom.alerts import detectors
from loom.alerts.detectors import Finding
from loom.alerts.models import Alert
from loom.alerts.services import record
from loom.alerts.triage import alert_views
from loom.checkpoints.services import pins_of
from loom.runs.models import Attempt

from .helpers import BatchSender, checkpoint_event, claimed_run

SLOW_RANK = 1


def rank_log(work_dir, rank: int, lines: list[str]) -> None:
    directory = work_dir / "logs" / "rdzv" / "attempt_0" / str(rank)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "stdout.log").write_text("\n".join(lines) + "\n")


def test_the_triage_page_names_suspects_offers_the_checkpoint_before_and_shows_logs(platform_user, tmp_path):
    user = platform_user[0]
    run, attempt, _ = claimed_run(user)
    Attempt.objects.filter(pk=attempt.pk).update(work_dir=str(tmp_path))
    attempt.refresh_from_db()
    sender = BatchSender(attempt)
    for step in (5, 10, 15):
        sender.send(-1, checkpoint_event("committed", step, f"{tmp_path}/checkpoints/step-{step}", time=time.time()))
    for rank in range(2):
        rank_log(tmp_path, rank, [f"rank {rank} step {step}/20 loss 4.0" for step in range(1, 21)])
    slow = Finding(detectors.STRAGGLER, 12, detectors.WARNING, "rank 1 is a straggler", rank=SLOW_RANK, ranks=(1,))
    slow_again = Finding(detectors.MEMORY_CREEP, 14, detectors.WARNING, "memory of rank 1 rose", rank=SLOW_RANK)
    spike = Finding(detectors.LOSS_SPIKE, 17, detectors.WARNING, "loss 40 at step 17")
    changes = record(attempt, [slow, slow_again, spike], lambda rank: "node-a")
    straggler, creep, loss_spike = changes.opened

    client = Client()
    client.force_login(user)
    page = client.get(f"/runs/{run.pk}/triage/").content.decode()
    # Rank 1, implicated twice, heads the suspects; its node too.
    assert page.index('data-suspect="rank 1"') < page.index('data-suspect="node-a"')
    assert 'class="suspect rank-suspect top-suspect" data-suspect="rank 1"' in page
    # Each alert offers the last checkpoint committed before its step.
    checkpoints = {checkpoint.step: checkpoint.pk for checkpoint in run.checkpoints.all()}
    card = page[page.index(f'id="alert-{straggler.pk}"') :]
    assert f'data-checkpoint="{checkpoints[10]}"' in card[: card.index("</article>")]
    card = page[page.index(f'id="alert-{loss_spike.pk}"') :]
    card = card[: card.index("</article>")]
    assert f'data-checkpoint="{checkpoints[15]}"' in card
    # Past the loss spike: skip the data of steps 16–17 and halve the learning rate (0.003), offered.
    assert 'data-first="16" data-last="17"' in card and 'class="restore-lr" step="any" min="0" value="0.0015"' in card
    # The straggler's card holds its rank's log around step 12.
    card = page[page.index(f'id="alert-{straggler.pk}"') :]
    card = card[: card.index("</article>")]
    assert "rank 1 step 12/20" in card and "rank 1 step 6/20" in card and "rank 1 step 19/20" not in card
    # A straggler is no reason to skip data.
    assert "skip-data" not in card
    # The timeline holds the checkpoints and the alerts.
    assert "checkpoint at step 15 (attempt 1)" in page and "loss 40 at step 17" in page

    found = client.get(f"/runs/{run.pk}/triage/", {"q": "STEP 20/"}).content.decode()
    assert "2 lines containing" in found
    assert "attempt 1 rank 0 stdout.log: rank 0 step 20/20" in found

    # The run list counts the live alerts, and none once they are resolved.
    assert ">3 open</a>" in client.get("/").content.decode()
    Alert.objects.filter(pk__in=[straggler.pk, creep.pk, loss_spike.pk]).update(state=Alert.RESOLVED)
    assert ">3 open</a>" not in client.get("/").content.decode()


def test_someone_elses_triage_page_is_a_404(platform_user, other_user):
    run, _, _ = claimed_run(platform_user[0])
    client = Client()
    client.force_login(other_user)
    assert client.get(f"/runs/{run.pk}/triage/").status_code == 404


def test_a_crash_past_the_last_heartbeat_gets_the_step_its_metrics_reached_and_the_checkpoint_before(
    platform_user, tmp_path
):
    """Killed in step 35: metrics reached 34 and a checkpoint 30, but the last heartbeat said step 22."""
    user = platform_user[0]
    run, attempt, _ = claimed_run(user)
    Attempt.objects.filter(pk=attempt.pk).update(work_dir=str(tmp_path))
    sender = BatchSender(attempt)
    for rank in range(2):
        beat = {"kind": "heartbeat", "time": time.time(), "step": 22, "payload": {"host": "node-a", "pid": 100}}
        metrics = [{"kind": "metric", "time": time.time(), "step": step, "payload": {}} for step in range(1, 35)]
        sender.send(rank, beat, *metrics)
        rank_log(tmp_path, rank, [f"rank {rank} step {step}/40 loss 4.0" for step in range(1, 35)])
    for step in (10, 20, 30):
        sender.send(0, checkpoint_event("committed", step, f"{tmp_path}/checkpoints/step-{step}", time=time.time()))
    failed = {
        "state": "failed", "exit_code": 1, "reason": "rank 1 was killed by SIGKILL", "failure_kind": "killed",
        "retryable": False, "failure_rank": 1, "failure_cause": "rank 1 was killed by SIGKILL",
    }  # fmt: skip
    sender.send(-1, {"kind": "state", "time": time.time(), "payload": {"state": "running"}})
    sender.send(-1, {"kind": "state", "time": time.time(), "payload": failed})

    exit_alert = Alert.objects.get(run=run, rule=detectors.RANK_EXIT)
    assert (exit_alert.rank, exit_alert.step) == (1, 34)
    (view,) = alert_views(run, [exit_alert])
    assert view.restore_from.step == 30
    assert [excerpt.lines[-1] for excerpt in view.logs] == ["rank 1 step 34/40 loss 4.0"]


def test_an_overfit_alert_offers_and_pins_the_checkpoint_at_its_lowest_validation_loss(platform_user, tmp_path):
    """Validation loss was lowest at step 20, the first evaluation of the rise: the checkpoint saved there is
    the model at its best, not the last one before the alert's step 50."""
    run, attempt, _ = claimed_run(platform_user[0])
    Attempt.objects.filter(pk=attempt.pk).update(work_dir=str(tmp_path))
    attempt.refresh_from_db()
    sender = BatchSender(attempt)
    for step in (10, 20, 30, 45):
        sender.send(-1, checkpoint_event("committed", step, f"{tmp_path}/checkpoints/step-{step}", time=time.time()))
    details = {"steps": [20, 30, 40, 50], "eval_losses": [2.0, 2.1, 2.2, 2.3]}
    overfitting = Finding(detectors.OVERFIT, 50, detectors.WARNING, "validation loss rose", details=details)
    (alert,) = record(attempt, [overfitting], lambda rank: "node-a").opened

    (view,) = alert_views(run, [alert])
    assert view.restore_from.step == 20
    assert view.skip_steps is None, "overfitting is no reason to skip data"
    pinned = pins_of(run)
    assert list(pinned) == [run.checkpoints.get(step=20).pk]
