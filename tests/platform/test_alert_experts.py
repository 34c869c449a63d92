"""The expert rules on the metric events of a mixture-of-experts run, stored through ingest as its ranks send
them: under pipeline parallelism each stage's rank reports its own layers, and a collapsed expert or an
imbalanced layer opens its alert, naming layer and expert, updates it, and clears once it has recovered."""

import random

import pytest

from loom.alerts import detectors
from loom.alerts.evaluate import evaluate
from loom.alerts.models import Alert
from loom.alerts.services import end_live_conditions
from loom.runs import states
from loom.runs.models import Attempt

from ..conftest import wait_for
from .helpers import TINY_CONFIG, BatchSender, claimed_run
from .test_alerts import rank_metric
from .test_ingest_scale import post

EXPERTS = 8
# Routed token copies a layer takes a step: an even share is 512 an expert.
ROUTED = EXPERTS * 512
# pp 2 over four layers: rank 0 holds the first stage's layers, rank 1 the last stage's.
STAGE_LAYERS = {0: (0, 1), 1: (2, 3)}
MOE_CONFIG = {
    **TINY_CONFIG,
    "model": {**TINY_CONFIG["model"], "layers": 4, "experts": EXPERTS, "top_k": 2},
    "parallel": {"pp": 2, "microbatches": 2},
}
STARVED = (3, 6)
HOGGED = (1, 4)


def routing(step: int, layers, starved=None, hogged=None) -> dict:
    """A step's `experts` as the trainer reports it (trainer/parallel/expert.py): per layer, tokens per expert
    within 5 % of an even share, drops and the balance loss. `starved` (layer, expert) receives 2 tokens;
    `hogged` (layer, expert) takes 6× the mean load."""
    rng = random.Random(step)
    experts = {}
    for layer in layers:
        load = [round(ROUTED / EXPERTS * rng.uniform(0.95, 1.05)) for _ in range(EXPERTS)]
        if starved is not None and starved[0] == layer:
            load[starved[1]] = 2
        if hogged is not None and hogged[0] == layer:
            busiest = 6 * ROUTED // EXPERTS
            rest = (ROUTED - busiest) // (EXPERTS - 1)
            load = [busiest if expert == hogged[1] else rest for expert in range(EXPERTS)]
        experts[str(layer)] = {"load": load, "dropped": 0, "balance_loss": 0.0101}
    return experts


def moe_metric(rank: int, step: int, **routed) -> dict:
    return rank_metric(rank, step, experts=routing(step, STAGE_LAYERS[rank], **routed))


def send(sender: BatchSender, steps, ranks=(0, 1), **routed):
    for rank in ranks:
        sender.send(rank, *[moe_metric(rank, step, **routed) for step in steps])


def test_a_collapsed_expert_opens_one_alert_naming_layer_and_expert_and_clears_once_it_has_recovered(platform_user):
    _, attempt, _ = claimed_run(platform_user[0], config=MOE_CONFIG)
    sender = BatchSender(attempt)
    send(sender, range(1, 5))
    # A malformed report (ingest stores any JSON) is left out; the other rules are judged all the same.
    broken = rank_metric(0, 5, experts={"0": {"load": [1, "2"]}, "1": "many", "x": {"load": [1, 2]}})
    sender.send(0, broken)
    send(sender, [5], ranks=(1,))
    send(sender, range(6, 11))
    # Expert 6 of layer 3 (rank 1's stage) receives 2 tokens of an even 512 from step 11: 19 steps are not 20.
    send(sender, range(11, 30), starved=STARVED)
    assert not evaluate(attempt, [], 0).changes
    # The first stage reports step 30 before the last stage does: layer 3 is judged on its own steps.
    send(sender, [30], ranks=(0,), starved=STARVED)
    assert not evaluate(attempt, [], 0).changes
    send(sender, [30], ranks=(1,), starved=STARVED)
    (alert,) = evaluate(attempt, [], 0).changes.opened
    assert (alert.rule, alert.rank, alert.ranks, alert.step, alert.severity, alert.state) == (
        detectors.EXPERT_COLLAPSE,
        None,
        [],
        30,
        "warning",
        Alert.OPEN,
    )
    assert alert.message.startswith("expert 6 of layer 3 collapsed: 2 tokens at step 30")
    (entry,) = alert.details["experts"]
    assert (entry["layer"], entry["expert"], entry["tokens"], entry["steps"]) == (3, 6, 2, [11, 30])
    # Still starved at later steps: the same alert, updated.
    send(sender, range(31, 34), starved=STARVED)
    changes = evaluate(attempt, [], 30).changes
    assert changes.updated == [alert] and not changes.opened
    alert.refresh_from_db()
    assert (alert.occurrences, alert.last_step) == (2, 33)
    # It gets its share again: clear_after_steps (20) steps after it was last seen, the alert resolves.
    send(sender, range(34, 53))
    assert not evaluate(attempt, [], 33).changes
    send(sender, [53])
    (resolved,) = evaluate(attempt, [], 52).changes.resolved
    assert resolved.pk == alert.pk and resolved.resolution == "cleared: not seen since step 33 (through step 53)"
    assert Alert.objects.count() == 1


def test_an_imbalanced_layer_opens_its_alert_with_its_ratio(platform_user):
    config = {**MOE_CONFIG, "alerts": {"expert_imbalance_steps": 5}}
    _, attempt, _ = claimed_run(platform_user[0], config=config)
    sender = BatchSender(attempt)
    send(sender, range(1, 11))
    send(sender, range(11, 15), hogged=HOGGED)
    assert not evaluate(attempt, [], 0).changes
    send(sender, [15], hogged=HOGGED)
    (alert,) = evaluate(attempt, [], 0).changes.opened
    assert (alert.rule, alert.rank, alert.step) == (detectors.EXPERT_IMBALANCE, None, 15)
    (entry,) = alert.details["layers"]
    assert (entry["layer"], entry["busiest_expert"], entry["steps"]) == (1, 4, [11, 15])
    assert entry["ratio"] > 4 and f"expert 4 received {entry['ratio']:.2f}× the layer's mean load" in alert.message
    assert alert.message.startswith("layer 1's expert load is imbalanced")


def test_a_collapse_found_after_its_attempt_ended_opens_and_outlives_the_attempt(platform_user):
    """The router is in the checkpoint: a collapse the watcher finds in the last metrics of an ended attempt
    opens, and the attempt's end resolves it not."""
    config = {**MOE_CONFIG, "alerts": {"expert_collapse_steps": 5}}
    _, attempt, _ = claimed_run(platform_user[0], config=config)
    sender = BatchSender(attempt)
    send(sender, range(1, 6), starved=STARVED)
    Attempt.objects.filter(pk=attempt.pk).update(state=states.SUCCEEDED)
    (alert,) = evaluate(attempt, [], 0).changes.opened
    assert alert.rule == detectors.EXPERT_COLLAPSE
    assert end_live_conditions(attempt).resolved == []
    alert.refresh_from_db()
    assert alert.state == Alert.OPEN


def test_expert_rules_set_to_zero_open_nothing(platform_user):
    config = {**MOE_CONFIG, "alerts": {"expert_collapse_share": 0, "expert_imbalance_ratio": 0}}
    _, attempt, _ = claimed_run(platform_user[0], config=config)
    sender = BatchSender(attempt)
    send(sender, range(1, 41), starved=STARVED)
    send(sender, range(41, 81), hogged=HOGGED)
    assert not evaluate(attempt, [], 0).changes
    assert not Alert.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_the_watcher_finds_a_collapsed_expert_in_what_the_ingest_endpoint_stored(platform_server, platform_user):
    run, attempt, token = claimed_run(platform_user[0], config={**MOE_CONFIG, "alerts": {"expert_collapse_steps": 5}})
    for seq, step in enumerate(range(1, 9)):
        for rank in STAGE_LAYERS:
            events = [moe_metric(rank, step, starved=STARVED if step >= 3 else None)]
            assert (
                post(platform_server.url, {"attempt": attempt.pk, "rank": rank, "seq": seq, "events": events}, token)[0]
                == 200
            )
    alert = wait_for(lambda: Alert.objects.filter(run=run).first(), timeout=10, message="the expert collapse alert")
    assert (alert.rule, alert.step) == (detectors.EXPERT_COLLAPSE, alert.details["experts"][0]["steps"][1])
    assert "expert 6 of layer 3 collapsed" in alert.message
    (entry,) = alert.details["experts"]
    assert (entry["layer"], entry["expert"], entry["steps"][0]) == (3, 6, 3)
