"""Alerts from telemetry stored through ingest: what evaluate() opens, updates and resolves, their lifecycle
through the API, and the watcher judging what the live ingest endpoint stored."""

import random
import time
from datetime import datetime, timedelta

import pytest
from django.db.models import F
from django.utils import timezone

from loom.alerts import detectors
from loom.alerts.evaluate import evaluate
from loom.alerts.hangs import check_hangs
from loom.alerts.models import Alert
from loom.alerts.services import Changes, clear_stale, record
from loom.runs import states
from loom.runs.models import Attempt
from loom.telemetry.models import RankStatus

from ..conftest import wait_for
from .helpers import TINY_CONFIG, BatchSender, claimed_run
from .test_api import api
from .test_ingest_scale import post

RANKS = 8
SLOW_RANK = 5


def rank_metric(rank: int, step: int, slow_rank: int | None = None, **extra) -> dict:
    rng = random.Random(step * 100 + rank)
    compute = 0.2 * (2.5 if rank == slow_rank else 1.0) * (1 + rng.gauss(0, 0.02))
    payload = {
        "loss_mean": 4.0 - step / 100 + rng.gauss(0, 0.01),
        "grad_norm": 1.0 + rng.gauss(0, 0.02),
        "step_time_s": 0.55,
        "compute_s": compute,
        "tokens_per_s": 2000.0 * (1 + rng.gauss(0, 0.01)),
        "memory_rss": 2**30 + rank * 2**20,
        **extra,
    }
    return {"kind": "metric", "time": time.time(), "step": step, "payload": payload}


def heartbeat(rank: int) -> dict:
    return {"kind": "heartbeat", "time": time.time(), "payload": {"host": f"node-{rank // 4}", "pid": 100 + rank}}


def send_steps(sender: BatchSender, steps, slow_rank=None):
    for rank in range(RANKS):
        sender.send(rank, *[rank_metric(rank, step, slow_rank) for step in steps])


@pytest.fixture
def sender(platform_user):
    _, attempt, _ = claimed_run(platform_user[0])
    sender = BatchSender(attempt)
    for rank in range(RANKS):
        sender.send(rank, heartbeat(rank))
    return sender


def test_a_straggler_opens_one_alert_naming_rank_and_node_and_clears_by_itself(sender):
    attempt = sender.attempt
    # The slow rank computes ~0.5 s a step: straggler_min_s (10 s) takes it 20 slow steps, not straggler_steps (5).
    send_steps(sender, range(1, 17), SLOW_RANK)
    assert not evaluate(attempt, [], 0).changes
    send_steps(sender, range(17, 25), SLOW_RANK)
    result = evaluate(attempt, [], 0)
    (alert,) = result.changes.opened
    assert (alert.rule, alert.rank, alert.host, alert.step, alert.state) == (
        detectors.STRAGGLER,
        SLOW_RANK,
        "node-1",
        24,
        Alert.OPEN,
    )
    # Judged on the whole of its slow spell, read back for its peers only once the short window saw it slow.
    assert alert.details["slow_steps"] >= 20 and alert.details["seconds"] >= 10
    assert result.judged_through == 24
    # Seen again at later steps: the same alert, updated.
    send_steps(sender, range(25, 28), SLOW_RANK)
    changes = evaluate(attempt, [], 24).changes
    assert changes.updated == [alert] and not changes.opened
    alert.refresh_from_db()
    assert (alert.occurrences, alert.last_step) == (2, 27)
    # The rank recovers: after clear_after_steps steps without it, the alert resolves.
    send_steps(sender, range(28, 47))
    assert not evaluate(attempt, [], 27).changes.resolved
    send_steps(sender, [47])
    (resolved,) = evaluate(attempt, [], 46).changes.resolved
    assert resolved.pk == alert.pk
    alert.refresh_from_db()
    assert alert.state == Alert.RESOLVED and alert.resolution.startswith("cleared")
    assert Alert.objects.count() == 1


def test_a_rank_slow_for_a_few_steps_opens_nothing(sender):
    send_steps(sender, range(1, 30))
    send_steps(sender, range(30, 40), SLOW_RANK)
    send_steps(sender, range(40, 60))
    send_steps(sender, range(60, 70), SLOW_RANK)
    assert not evaluate(sender.attempt, [], 0).changes


def test_a_pipeline_straggler_is_judged_among_its_stage_over_its_whole_slow_spell(platform_user):
    # pp2 x dp_replicate 4: ranks 0-3 hold the first stage, 4-7 the last, which does twice the work.
    config = {**TINY_CONFIG, "parallel": {"pp": 2, "dp_replicate": 4, "microbatches": 2}}
    _, attempt, _ = claimed_run(platform_user[0], config=config)
    pipelined = BatchSender(attempt)
    for rank in range(RANKS):
        pipelined.send(rank, heartbeat(rank))

    def send(steps, slow_rank=None):
        for rank in range(RANKS):
            metrics = [rank_metric(rank, step, slow_rank) for step in steps]
            for metric in metrics:
                metric["payload"]["compute_s"] *= 2 if rank >= 4 else 1
            pipelined.send(rank, *metrics)

    send(range(1, 30))
    # The slow rank, of the last stage, computes ~1 s a step against its peers' 0.4 s: eight steps are not yet
    # straggler_min_s, and the last stage's ranks are no stragglers for doing twice the first stage's work.
    send(range(30, 38), SLOW_RANK)
    assert not evaluate(attempt, [], 0).changes
    send(range(38, 42), SLOW_RANK)
    (alert,) = evaluate(attempt, [], 0).changes.opened
    assert (alert.rule, alert.rank, alert.step) == (detectors.STRAGGLER, SLOW_RANK, 41)
    assert alert.details["peer_group"] == "pipeline rank 1" and alert.details["seconds"] >= 10


def test_a_clean_run_opens_nothing(sender):
    send_steps(sender, range(1, 80))
    assert not evaluate(sender.attempt, [], 0).changes
    assert not Alert.objects.exists()


def test_a_run_with_alerts_disabled_opens_nothing(platform_user):
    _, attempt, _ = claimed_run(platform_user[0], config={**TINY_CONFIG, "alerts": {"enabled": False}})
    sender = BatchSender(attempt)
    send_steps(sender, range(1, 10), SLOW_RANK)
    assert not evaluate(attempt, [(0, 3, "loss", "NaN")], 0).changes
    assert not Alert.objects.exists()


def test_a_loss_spike_in_stored_steps_is_found_once(sender):
    attempt = sender.attempt
    send_steps(sender, range(1, 30))
    for rank in range(RANKS):
        sender.send(rank, rank_metric(rank, 30, loss_mean=40.0))
    (alert,) = evaluate(attempt, [], 0).changes.opened
    assert (alert.rule, alert.step, alert.rank) == (detectors.LOSS_SPIKE, 30, None)
    # Judged through step 30: the next pass does not count it again.
    send_steps(sender, [31])
    assert not evaluate(attempt, [], 30).changes


def test_two_passes_finding_the_same_thing_keep_one_live_alert_per_rule_and_rank(sender):
    finding = detectors.Finding(detectors.STRAGGLER, 7, detectors.WARNING, "slow", rank=3, ranks=(3,))
    first = record(sender.attempt, [finding], str)
    again = record(sender.attempt, [finding], str)
    assert len(first.opened) == 1 and again == Changes([], [], [])
    other_rank = record(sender.attempt, [detectors.Finding(detectors.STRAGGLER, 7, "warning", "slow", rank=4)], str)
    assert len(other_rank.opened) == 1
    assert Alert.objects.filter(state=Alert.OPEN).count() == 2


def test_acknowledge_and_resolve_through_the_api(client, sender, platform_user, other_user, token_for):
    finding = detectors.Finding(detectors.NON_FINITE, 12, detectors.CRITICAL, "loss not finite", ranks=(0, 1))
    (alert,) = record(sender.attempt, [finding], str).opened
    token = token_for(platform_user[0])
    run_id = sender.attempt.run_id

    listed = api(client, "get", f"/api/runs/{run_id}/alerts?state=live", token).json()
    assert [(item["id"], item["rule"], item["ranks"], item["attempt"]) for item in listed] == [
        (alert.pk, detectors.NON_FINITE, [0, 1], 1)
    ]
    answer = api(client, "post", f"/api/alerts/{alert.pk}/acknowledge", token)
    assert answer.status_code == 200 and answer.json()["state"] == Alert.ACKNOWLEDGED
    again = api(client, "post", f"/api/alerts/{alert.pk}/acknowledge", token)
    assert again.status_code == 400 and "acknowledged" in again.json()["errors"]["state"]
    # Someone else's alert is no one's.
    assert api(client, "post", f"/api/alerts/{alert.pk}/resolve", token_for(other_user)).status_code == 404
    assert api(client, "get", f"/api/runs/{run_id}/alerts", token_for(other_user)).status_code == 404

    resolved = api(client, "post", f"/api/alerts/{alert.pk}/resolve", token).json()
    assert resolved["state"] == Alert.RESOLVED and resolved["resolution"] == "resolved by ada"
    assert api(client, "get", f"/api/runs/{run_id}/alerts?state=live", token).json() == []
    # Resolved, the same condition opens a new alert.
    assert len(record(sender.attempt, [finding], str).opened) == 1


@pytest.mark.django_db(transaction=True)
def test_the_watcher_judges_what_the_ingest_endpoint_stored_within_seconds(platform_server, platform_user):
    run, attempt, token = claimed_run(platform_user[0])
    for step in range(1, 6):
        events = [rank_metric(0, step)]
        if step == 4:
            events[0]["payload"]["loss_mean"] = "NaN"
            events[0]["payload"]["grad_norm"] = "Infinity"
        assert (
            post(platform_server.url, {"attempt": attempt.pk, "rank": 0, "seq": step, "events": events}, token)[0]
            == 200
        )
    alert = wait_for(lambda: Alert.objects.filter(run=run).first(), timeout=10, message="the non-finite alert")
    assert (alert.rule, alert.step, alert.severity, alert.ranks) == (detectors.NON_FINITE, 4, "critical", [0])
    assert "grad_norm" in alert.message and "loss_mean" in alert.message


# Every rank's clock is an hour slow: hangs are judged by when the platform stored what it heard.
SKEW_S = -3600.0


def beat(rank: int, step: int | None, collectives: dict | None = None) -> dict:
    payload = {"host": f"node-{rank // 4}", "pid": 100 + rank}
    if collectives is not None:
        payload["collectives"] = collectives
    return {"kind": "heartbeat", "time": time.time() + SKEW_S, "step": step, "payload": payload}


def skewed_metric(rank: int, step: int) -> dict:
    return {**rank_metric(rank, step), "time": time.time() + SKEW_S}


def progress(issued: int, waiting: bool, quiet_s: float = 60.0) -> dict:
    """A heartbeat's collective progress on a four-rank data-parallel group."""
    wait = {"op": "all_reduce", "ranks": [0, 1, 2, 3], "for_s": quiet_s} if waiting else None
    return {"groups": [{"ranks": [0, 1, 2, 3], "issued": issued}], "peers": [], "waiting": wait, "quiet_s": quiet_s}


def heard_at(attempt: Attempt, rank: int) -> datetime:
    return RankStatus.objects.get(attempt=attempt, rank=rank).heard_at


def heard_ago(attempt: Attempt, seconds: float) -> None:
    """As if everything the platform has heard from the attempt so far had been stored `seconds` earlier."""
    earlier = F("received_at") - timedelta(seconds=seconds)
    attempt.events.update(received_at=earlier)
    RankStatus.objects.filter(attempt=attempt).update(heard_at=F("heard_at") - timedelta(seconds=seconds))


def running_attempt(user, started_at: datetime | None = None) -> Attempt:
    """A claimed four-rank attempt, running since `started_at` (now by default)."""
    _, attempt, _ = claimed_run(user, config={**TINY_CONFIG, "parallel": {"dp_replicate": 4}})
    Attempt.objects.filter(pk=attempt.pk).update(state=states.RUNNING, started_at=started_at or timezone.now())
    attempt.refresh_from_db()
    return attempt


def test_hangs_a_silent_rank_a_stalled_run_the_grace_before_the_first_step_and_clearing(platform_user):
    # Building the model for 300 s so far, every rank beating: within the 600 s grace, nothing.
    attempt = running_attempt(platform_user[0], started_at=timezone.now() - timedelta(seconds=300))
    sender = BatchSender(attempt)
    for rank in range(4):
        sender.send(rank, beat(rank, None))
    assert check_hangs(heard_at(attempt, 0) + timedelta(seconds=10)) == [Changes([], [], [])]
    # Rank 3 never beats again; 140 s later the others report step 1 and go on beating.
    heard_ago(attempt, 140)
    silent_since = heard_at(attempt, 3)
    for rank in range(3):
        sender.send(rank, skewed_metric(rank, 1), beat(rank, 1))
    (changes,) = check_hangs(silent_since + timedelta(seconds=145))
    (silent,) = changes.opened
    assert (silent.rule, silent.rank, silent.host) == (detectors.HANG, 3, "node-0")
    assert "no heartbeat from rank 3 for 145 s" in silent.message
    # 121 s after step 1 was stored, the ranks still beating, the run as a whole is stalled at it; without
    # collective progress no rank can be named.
    heard_ago(attempt, 121)
    for rank in range(3):
        sender.send(rank, beat(rank, 1))
    stored = attempt.events.filter(kind="metric", step=1).latest("received_at").received_at
    (changes,) = check_hangs(stored + timedelta(seconds=121))
    (stalled,) = changes.opened
    assert (stalled.rank, stalled.step, stalled.ranks) == (None, 1, [])
    assert "no step completed for 121 s (since step 1)" in stalled.message
    assert "telemetry.comm" in stalled.message
    # Rank 3 is back and step 2 completes: both clear.
    for rank in range(4):
        sender.send(rank, skewed_metric(rank, 2), beat(rank, 2))
    (changes,) = check_hangs(timezone.now())
    assert {alert.pk for alert in changes.resolved} == {silent.pk, stalled.pk}
    assert not Alert.objects.filter(state__in=Alert.LIVE).exists()


def test_an_attempt_past_its_last_step_is_not_hung_while_it_exits(platform_user):
    attempt = running_attempt(platform_user[0])
    sender = BatchSender(attempt)
    last = TINY_CONFIG["steps"]
    for rank in range(4):
        sender.send(rank, skewed_metric(rank, last - 1), beat(rank, last - 1))
    heard_ago(attempt, 130)
    stored = attempt.events.filter(kind="metric", step=last - 1).latest("received_at").received_at
    # One step short of the end and silent since: hung.
    (changes,) = check_hangs(stored + timedelta(seconds=130))
    assert {alert.rank for alert in changes.opened} == {None, 0, 1, 2, 3}
    # Every step done and silent since (saving, flushing, exiting on a loaded host): nothing to raise, and what
    # was raised clears.
    for rank in range(4):
        sender.send(rank, skewed_metric(rank, last), beat(rank, last))
    heard_ago(attempt, 130)
    stored = attempt.events.filter(kind="metric", step=last).latest("received_at").received_at
    (changes,) = check_hangs(stored + timedelta(seconds=130))
    assert changes.opened == [] and len(changes.resolved) == 5


def test_a_stalled_run_names_the_rank_the_others_wait_for_once_their_progress_settles(platform_user):
    attempt = running_attempt(platform_user[0])
    sender = BatchSender(attempt)
    for rank in range(4):
        sender.send(rank, skewed_metric(rank, 7))
    heard_ago(attempt, 130)
    stored = attempt.events.filter(kind="metric", step=7).latest("received_at").received_at
    # Mid-step, counts differ for a moment: that is no evidence.
    for rank in range(4):
        sender.send(rank, beat(rank, 7, progress(40 + rank % 2, waiting=rank % 2 == 1, quiet_s=0.01)))
    (changes,) = check_hangs(stored + timedelta(seconds=130))
    (stalled,) = changes.opened
    assert stalled.ranks == [] and "rank" not in stalled.message.split(";")[0]
    # Settled: ranks 0, 1 and 3 issued their 41st collective and wait in it; rank 2 never issued it.
    for rank in range(4):
        sender.send(rank, beat(rank, 7, progress(40 if rank == 2 else 41, waiting=rank != 2)))
    (changes,) = check_hangs(stored + timedelta(seconds=140))
    assert changes.updated == [stalled]
    stalled.refresh_from_db()
    assert stalled.ranks == [2]
    assert "rank 2 (on node-0) is the one the others wait for" in stalled.message
    assert "it issued 40 collectives on ranks [0, 1, 2, 3], ranks 0, 1, 3 issued 41" in stalled.message
    assert stalled.details["culprits"][0]["rank"] == 2 and stalled.details["culprits"][0]["waiting"] is False
    assert set(stalled.details["waiting"]) == {"0", "1", "3"}


def test_a_rank_whose_metrics_arrive_is_not_silent_though_its_heartbeats_are_late(platform_user):
    """A heartbeat thread starved of CPU on a busy host sends late; the rank's steps still arrive."""
    attempt = running_attempt(platform_user[0])
    sender = BatchSender(attempt)
    for rank in range(4):
        sender.send(rank, beat(rank, None))
    heard_ago(attempt, 200)
    for rank in range(4):
        sender.send(rank, skewed_metric(rank, 1))
    assert check_hangs(timezone.now() + timedelta(seconds=5)) == [Changes([], [], [])]
    # Rank 2's metrics stop too: now it is silent.
    heard_ago(attempt, 200)
    for rank in (0, 1, 3):
        sender.send(rank, skewed_metric(rank, 2))
    (changes,) = check_hangs(timezone.now())
    (silent,) = changes.opened
    assert (silent.rule, silent.rank) == (detectors.HANG, 2)


@pytest.mark.parametrize("outcome", [states.SUCCEEDED, states.FAILED, states.CANCELLED])
def test_an_ended_attempt_resolves_its_live_conditions_and_leaves_what_a_person_must_act_on(
    client, sender, platform_user, outcome
):
    attempt = sender.attempt
    live_conditions = [
        detectors.Finding(detectors.STRAGGLER, 12, detectors.WARNING, "rank 5 is slow", rank=SLOW_RANK),
        detectors.Finding(detectors.THROUGHPUT_DROP, 13, detectors.WARNING, "tokens/s fell"),
        detectors.Finding(detectors.MEMORY_CREEP, 14, detectors.WARNING, "memory of rank 2 rose", rank=2),
        detectors.Finding(detectors.HANG, 15, detectors.CRITICAL, "no step for 60 s"),
    ]
    about_the_model = [
        detectors.Finding(detectors.LOSS_SPIKE, 16, detectors.WARNING, "loss 40 at step 16"),
        detectors.Finding(detectors.GRAD_NORM_SPIKE, 16, detectors.WARNING, "grad norm 90 at step 16"),
        detectors.Finding(detectors.NON_FINITE, 17, detectors.CRITICAL, "loss not finite", ranks=(0, 1)),
    ]
    record(attempt, live_conditions + about_the_model, str)
    final = {"state": outcome, "exit_code": 0 if outcome == states.SUCCEEDED else 1, "reason": "", "retryable": False}
    sender.send(-1, {"kind": "state", "time": time.time(), "payload": {"state": states.RUNNING}})
    sender.send(-1, {"kind": "state", "time": time.time(), "payload": final})

    alerts = {alert.rule: alert for alert in Alert.objects.filter(run_id=attempt.run_id)}
    for finding in live_conditions:
        ended = alerts[finding.rule]
        assert (ended.state, ended.resolution) == (Alert.RESOLVED, f"attempt 1 ended ({outcome})")
    # A failed attempt adds its rank-exit alert, which stays open too.
    must_act = {finding.rule for finding in about_the_model} | ({detectors.RANK_EXIT} if outcome == "failed" else set())
    assert {rule for rule, alert in alerts.items() if alert.state == Alert.OPEN} == must_act
    # The watcher's last pass over the ended attempt's metrics opens no live condition again.
    late = detectors.Finding(detectors.STRAGGLER, 20, detectors.WARNING, "rank 5 is slow", rank=SLOW_RANK)
    assert not record(attempt, [late], str)
    client.force_login(platform_user[0])
    assert f">{len(must_act)} open</a>" in client.get("/").content.decode()


def test_a_spike_waits_for_a_person_however_many_steps_pass_while_a_straggler_clears(sender):
    straggler = detectors.Finding(detectors.STRAGGLER, 12, detectors.WARNING, "rank 5 is slow", rank=SLOW_RANK)
    spike = detectors.Finding(detectors.LOSS_SPIKE, 12, detectors.WARNING, "loss 40 at step 12")
    record(sender.attempt, [straggler, spike], str)
    (cleared,) = clear_stale(sender.attempt, 1000, 20)
    assert cleared.rule == detectors.STRAGGLER
    assert Alert.objects.get(rule=detectors.LOSS_SPIKE).state == Alert.OPEN
