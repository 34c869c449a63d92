"""End to end with the real worker and trainer: a rank killed mid-run, and the run recovers by itself."""

import pytest
from django.test import Client

from loom.checkpoints.models import Checkpoint
from loom.checkpoints.resilience import resilience
from loom.runs import states
from loom.runs.models import Run
from loom.runs.services import create_run

from ..conftest import wait_for
from .helpers import TINY_CONFIG

pytestmark = pytest.mark.slow

CHECKPOINTED = {**TINY_CONFIG, "checkpoint": {"interval_steps": 5}}


def losses(run: Run, attempt_number: int) -> dict[int, float]:
    events = run.events.filter(kind="metric", rank=0, attempt__number=attempt_number)
    return {event.step: event.payload["loss_mean"] for event in events}


def test_a_killed_rank_restarts_from_the_last_checkpoint_and_the_curve_continues(live_platform, platform_user):
    user = platform_user[0]
    killed = create_run(user, "killed at 7", {**CHECKPOINTED, "faults": {"kill_at_step": 7, "kill_rank": 1}})
    straight = create_run(user, "uninterrupted", CHECKPOINTED)
    for run in (killed, straight):
        # A restart is created in the transaction that fails its predecessor: the run is terminal only at the end.
        wait_for(
            lambda run=run: Run.objects.filter(pk=run.pk, state__in=states.TERMINAL).exists(),
            timeout=300,
            message=f"{run.name} to end",
        )
    killed.refresh_from_db()
    first, second = killed.attempts.order_by("number")
    assert killed.state == states.SUCCEEDED, [(a.number, a.state, a.failure_reason) for a in killed.attempts.all()]
    assert (first.state, first.failure_kind, first.retryable) == (states.FAILED, "killed", True)
    assert "rank 1 was killed by SIGKILL" in first.failure_reason
    assert first.restart_decision == "restarted as attempt 2 from its checkpoints (newest: step 5)"
    step5 = Checkpoint.objects.get(attempt=first, step=5)
    assert (second.trigger, second.restored_from, second.state) == ("restart", step5, states.SUCCEEDED)
    assert "automatic restart 1 of 3" in second.trigger_note
    # The restart loaded step 5, trained 6–20, and its losses are the uninterrupted run's (fp32, same data order).
    loaded = killed.events.get(kind="checkpoint", attempt=second, payload__state="loaded")
    assert loaded.step == 5
    restarted, reference = losses(killed, 2), losses(straight, 1)
    assert sorted(restarted) == list(range(6, 21))
    for step, loss in restarted.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step
    assert losses(killed, 1) == pytest.approx({step: reference[step] for step in range(1, 7)}, rel=1e-5)

    figures = resilience(killed)
    (failure,) = figures["failures"]
    assert (failure["last_step"], failure["resumed_step"], failure["rpo_steps"]) == (6, 5, 1)
    assert failure["rto_s"] is not None and failure["rto_s"] > 0
    assert 0 < figures["ettr"] < 1
    print(f"\nRTO {failure['rto_s']:.2f} s, ETTR {figures['ettr']:.3f}, stall {figures['checkpoint_stall_s']}")

    client = Client()
    client.force_login(user)
    page = client.get(f"/runs/{killed.pk}/").content.decode()
    assert "rank 1 was killed by SIGKILL" in page and "automatic restart 1 of 3" in page
    lineage = client.get(f"/api/runs/{killed.pk}/lineage").json()
    attempts = {node["number"]: node for node in lineage["attempts"]}
    assert attempts[2]["restored_from"] == step5.pk and attempts[1]["failure_kind"] == "killed"
    assert (attempts[1]["last_step"], attempts[2]["last_step"]) == (6, 20)
    by_id = {node["id"]: node for node in lineage["checkpoints"]}
    assert by_id[step5.pk]["attempt"] == first.pk
    assert {node["step"] for node in lineage["checkpoints"] if node["attempt"] == second.pk} == {10, 15, 20}
