"""Validation loss through the platform: metric events carrying eval_loss, stored by the real ingest service,
projected into its own column, served by the run's metrics API as a series of the evaluated steps only, and
judged by the overfitting detector on the database's rows."""

import json
import time

import pytest

from loom.alerts import detectors
from loom.alerts.evaluate import evaluate
from loom.alerts.models import Alert
from loom.telemetry.models import RankStep

from .helpers import TINY_CONFIG, BatchSender, claimed_run

pytestmark = pytest.mark.django_db

RANKS = 2
STEPS = 60
INTERVAL = 10
EVALUATING = {**TINY_CONFIG, "steps": STEPS, "eval": {"interval_steps": INTERVAL}}


def train_loss(step: int) -> float:
    return 4.0 - step / 100


def overfitting(step: int) -> float:
    """Falls to step 30, then rises at each evaluation."""
    return 3.5 - step / 100 if step <= 30 else 3.2 + (step - 30) / 50


def learning(step: int) -> float:
    return 3.5 - step / 200


def metric(step: int, eval_loss=None) -> dict:
    payload = {"loss": train_loss(step), "loss_mean": train_loss(step), "grad_norm": 1.0, "step_time_s": 0.1}
    if eval_loss is not None and step % INTERVAL == 0:
        payload["eval_loss"] = eval_loss(step)
    return {"kind": "metric", "time": time.time(), "step": step, "payload": payload}


def trained(user, eval_loss, name="evaluating", steps=range(1, STEPS + 1)):
    """A run whose ranks reported `steps`, each evaluated step with the same validation loss on every rank."""
    run, attempt, _ = claimed_run(user, name, EVALUATING)
    sender = BatchSender(attempt)
    for rank in range(RANKS):
        sender.send(rank, *[metric(step, eval_loss) for step in steps])
    return run, attempt


def test_eval_loss_is_stored_in_its_column_on_the_evaluated_steps_only(platform_user):
    _, attempt = trained(platform_user[0], learning)
    rows = RankStep.objects.filter(attempt=attempt, rank=0).order_by("step").values_list("step", "eval_loss")
    evaluated = {step: value for step, value in rows if value is not None}
    assert evaluated == {step: pytest.approx(learning(step)) for step in range(INTERVAL, STEPS + 1, INTERVAL)}
    assert RankStep.objects.filter(attempt=attempt, eval_loss__isnull=False).count() == RANKS * STEPS // INTERVAL


def test_the_metrics_api_serves_validation_loss_as_a_series_of_its_own(client, platform_user):
    user = platform_user[0]
    run, _ = trained(user, learning)
    client.force_login(user)
    (attempt,) = client.get(f"/api/runs/{run.pk}/metrics/series?width=800").json()["attempts"]
    curve = attempt["series"]["eval_loss"]
    # Only the evaluated steps: no gaps of None between them.
    assert curve["step"] == list(range(INTERVAL, STEPS + 1, INTERVAL))
    assert curve["value"] == pytest.approx([learning(step) for step in curve["step"]])
    assert attempt["series"]["loss_mean"]["step"] == list(range(1, STEPS + 1))
    # A zoomed-in range keeps the evaluations inside it.
    (zoomed,) = client.get(f"/api/runs/{run.pk}/metrics/series?width=800&start=15&end=42").json()["attempts"]
    assert zoomed["series"]["eval_loss"]["step"] == [20, 30, 40]


def test_a_run_that_never_evaluates_has_an_empty_validation_series(client, platform_user):
    user = platform_user[0]
    run, _ = trained(user, None, "no eval")
    client.force_login(user)
    (attempt,) = client.get(f"/api/runs/{run.pk}/metrics/series").json()["attempts"]
    assert attempt["series"]["eval_loss"] == {"step": [], "value": []}
    assert len(attempt["series"]["loss_mean"]["step"]) == STEPS


def test_a_non_finite_validation_loss_is_stored_as_sent_and_no_point(client, platform_user):
    user = platform_user[0]
    run, attempt, _ = claimed_run(user, "diverged", EVALUATING)
    sender = BatchSender(attempt)
    sender.send(0, metric(10, learning), {**metric(20), "payload": {**metric(20)["payload"], "eval_loss": "NaN"}})
    assert run.events.get(step=20).payload["eval_loss"] == "NaN"
    client.force_login(user)
    (answer,) = client.get(f"/api/runs/{run.pk}/metrics/series").json()["attempts"]
    assert answer["series"]["eval_loss"]["step"] == [10]


def test_an_eval_loss_no_row_can_hold_is_refused_naming_it_and_stores_nothing(client, platform_user):
    run, attempt, token = claimed_run(platform_user[0], "too large", EVALUATING)
    bad = {**metric(10), "payload": {**metric(10)["payload"], "eval_loss": 2**64}}
    body = {"attempt": attempt.pk, "rank": 0, "seq": 0, "events": [metric(9), bad]}
    response = client.post(
        "/api/ingest", data=json.dumps(body), content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}"
    )
    assert response.status_code == 400
    assert response.json()["errors"] == {
        "events.1.payload.eval_loss": "must be an integer within 64 bits (-2**63 to 2**63 - 1)"
    }
    assert not run.events.filter(kind="metric").exists() and not RankStep.objects.filter(attempt=attempt).exists()


def test_the_compare_page_has_a_validation_loss_chart(client, platform_user):
    user = platform_user[0]
    run, _ = trained(user, learning)
    client.force_login(user)
    page = client.get(f"/runs/compare/?runs={run.pk}").content.decode()
    assert 'id="eval-loss-chart" class="chart" data-series="eval_loss"' in page


def test_an_overfitting_run_opens_one_warning_from_its_stored_evaluations(platform_user):
    run, attempt = trained(platform_user[0], overfitting)
    changes = evaluate(attempt, [], 0).changes
    (alert,) = [alert for alert in changes.opened if alert.rule == detectors.OVERFIT]
    assert (alert.severity, alert.step, alert.rank) == ("warning", STEPS, None)
    assert alert.details["steps"] == [30, 40, 50, 60]
    assert "validation loss rose from 3.2 to 3.8" in alert.message and "training loss fell" in alert.message
    # Judged through the latest evaluation: a pass with no new one reads nothing and opens nothing more.
    assert not evaluate(attempt, [], STEPS).changes.opened
    assert Alert.objects.filter(run=run, rule=detectors.OVERFIT).count() == 1


def test_a_learning_run_and_one_without_evaluations_open_no_overfit_alert(platform_user):
    user = platform_user[0]
    for eval_loss in (learning, None):
        run, attempt = trained(user, eval_loss, f"judged {eval_loss}")
        evaluate(attempt, [], 0)
        assert not Alert.objects.filter(run=run, rule=detectors.OVERFIT).exists()
