"""A real Celery worker launches a real torchrun attempt that reports through the real ingest API."""

import json
import os
import subprocess
import sys
import urllib.request

import pytest
from django.db.models import Q

from loom.runs import states
from loom.runs.hardware import launch_gpus
from loom.runs.models import Attempt, Run
from loom.runs.services import create_run
from loom.runs.tasks import launch_attempt
from loom.telemetry.models import IngestBatch
from trainer.telemetry import read_spool

from ..conftest import PlatformServer, free_port, wait_for
from .helpers import TINY_CONFIG, claimed_run

pytestmark = pytest.mark.slow


def api(url: str, token: str, method: str = "GET", body=None) -> dict:
    request = urllib.request.Request(
        url,
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def metric_steps(run: Run, rank: int) -> list[int]:
    return list(run.events.filter(kind="metric", rank=rank).order_by("step").values_list("step", flat=True))


def test_run_through_celery_trains_reports_every_step_and_ignores_a_second_delivery(
    live_platform, platform_user, token_for
):
    token = token_for(platform_user[0])
    created = api(f"{live_platform.url}/api/runs", token, "POST", {"name": "through celery", "config": TINY_CONFIG})
    attempt = Attempt.objects.get(run_id=created["id"], number=1)
    launch_attempt.delay(attempt.pk)  # the same attempt delivered twice must launch once

    run = wait_for(
        lambda: Run.objects.filter(pk=created["id"], state__in=states.TERMINAL).first(),
        timeout=180,
        message="the run to finish",
    )
    attempt.refresh_from_db()
    assert (run.state, attempt.exit_code) == (states.SUCCEEDED, 0), attempt.failure_reason
    for rank in (0, 1):
        assert metric_steps(run, rank) == list(range(1, 21))
    assert lifecycle_states(run) == [states.QUEUED, states.STARTING, states.RUNNING, states.SUCCEEDED]
    for rank in (0, 1):
        trainer_states = [e.payload["state"] for e in run.events.filter(kind="state", rank=rank).order_by("seq")]
        assert trainer_states == ["started", "finished"]
    losses = [e.payload["loss_mean"] for e in run.events.filter(kind="metric", rank=0).order_by("step")]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5

    seqs = list(run.events.order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, run.last_seq + 1))
    logs = api(f"{live_platform.url}/api/runs/{run.pk}/attempts/1/logs/1", token)
    assert any("step 20/20" in line for line in logs["files"]["stdout.log"])
    detail = api(f"{live_platform.url}/api/runs/{run.pk}", token)
    assert detail["attempts"][0]["state"] == states.SUCCEEDED and detail["attempts"][0]["finished_at"]


def test_ranks_and_the_launcher_report_to_an_ingest_process_of_its_own(live_platform, platform_user, settings):
    """With LOOM_INGEST_URL set, telemetry goes there and nowhere else: the platform's own address is
    made unreachable, and every step and state still arrives through the other server."""
    ingest = PlatformServer(free_port()).start()
    try:
        settings.LOOM_INGEST_URL = ingest.url
        settings.LOOM_URL = f"http://127.0.0.1:{free_port()}"
        run = create_run(platform_user[0], "ingest apart", {**TINY_CONFIG, "steps": 5})
        run = wait_for(
            lambda: Run.objects.filter(pk=run.pk, state__in=states.TERMINAL).first(),
            timeout=180,
            message="the run to finish",
        )
    finally:
        ingest.stop()
    assert run.state == states.SUCCEEDED, run.attempts.get().failure_reason
    for rank in (0, 1):
        assert metric_steps(run, rank) == list(range(1, 6))
    assert lifecycle_states(run) == [states.QUEUED, states.STARTING, states.RUNNING, states.SUCCEEDED]


def test_ranks_train_on_the_hardware_the_launch_warnings_were_given(live_platform, platform_user, token_for):
    """The warnings at creation come from the launcher's hardware as the platform probes it; the ranks
    then report the device they really trained on, and the two agree."""
    config = {**TINY_CONFIG, "steps": 3, "compute": {"precision": "bf16"}}
    cluster = {"gpu": "H100-SXM", "nodes": 1, "gpus_per_node": 2}
    body = {"name": "planned for H100s", "config": config, "cluster": cluster}
    created = api(f"{live_platform.url}/api/runs", token_for(platform_user[0]), "POST", body)
    run = wait_for(
        lambda: Run.objects.filter(pk=created["id"], state__in=states.TERMINAL).first(),
        timeout=180,
        message="the run to finish",
    )
    assert run.state == states.SUCCEEDED, run.attempts.get().failure_reason
    started = [event.payload for event in run.events.filter(kind="state", rank__gte=0, payload__state="started")]
    assert len(started) == 2
    gpus = launch_gpus()
    if gpus:
        assert {payload["device_name"] for payload in started} == {gpus[0]}
        assert "config.compute.precision" not in created["warnings"]
    else:
        assert {(payload["device"], payload["device_name"]) for payload in started} == {("cpu", "CPU")}
        assert created["warnings"]["config.compute.precision"].startswith("bf16 but the launcher has no GPU")
        assert created["warnings"]["cluster.gpu"].endswith(
            "the ranks will train on CPU, where the prediction does not apply"
        )


def finished_ranks(spool) -> set[int]:
    """The ranks whose spool holds their "finished" state event, emitted after their last step's metrics."""
    return {
        batch["rank"]
        for batch in read_spool(spool)
        for event in batch["events"]
        if event["kind"] == "state" and event["payload"]["state"] == "finished"
    }


def test_spool_delivers_every_event_after_the_platform_was_unreachable(
    platform_user, platform_server, runs_dir, tmp_path
):
    run, attempt, token = claimed_run(platform_user[0], "offline start")
    (tmp_path / "config.json").write_text(json.dumps(run.config))
    port = free_port()
    spool = tmp_path / "spool"
    env = {
        **os.environ,
        "LOOM_URL": f"http://127.0.0.1:{port}",
        "LOOM_TOKEN": token,
        "LOOM_ATTEMPT": str(attempt.pk),
        "LOOM_SPOOL_DIR": str(spool),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "trainer.train", "--config", str(tmp_path / "config.json")]  # fmt: skip
    # A file, not a pipe nobody reads while the test waits; printed at the end, which pytest shows
    # only when the test fails.
    output = tmp_path / "trainer.log"
    with output.open("wb") as log:
        trainer = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    late_server = None
    try:
        # Wait for every step, not for a number of batches: how many batches a rank cuts depends on how
        # its events fall into flush intervals, and on an idle machine the 20 steps take about 0.2 s, so
        # a rank can spool everything in two batches and a wait for three never ends. A rank spools
        # "finished" just before it closes its client, which keeps retrying for FINAL_TELEMETRY_TIMEOUT_S
        # (30 s): the platform comes up while the trainer still runs, and every step goes through the spool.
        wait_for(
            lambda: trainer.poll() is not None or finished_ranks(spool) == {0, 1},
            timeout=180,
            message="both ranks to spool every event while the platform is down",
        )
        assert trainer.poll() is None, f"the trainer exited with {trainer.returncode} before spooling every event"
        assert run.events.filter(rank__gte=0).count() == 0
        late_server = PlatformServer(port).start()
        trainer.wait(timeout=180)
    finally:
        trainer.kill()
        if late_server:
            late_server.stop()
        print(f"trainer output:\n{output.read_text(errors='replace')}")
    assert trainer.returncode == 0
    for rank in (0, 1):
        assert metric_steps(run, rank) == list(range(1, 21))
        batch_seqs = sorted(IngestBatch.objects.filter(attempt=attempt, rank=rank).values_list("seq", flat=True))
        assert batch_seqs == list(range(len(batch_seqs)))
        assert not list((spool / f"rank{rank}").glob("*.json")), "every spooled batch was delivered and removed"


def test_a_crashing_rank_fails_the_run_with_its_traceback_as_the_reason(live_platform, platform_user):
    from loom.runs.services import create_run

    config = {**TINY_CONFIG, "faults": {"crash_at_step": 3, "crash_rank": 1}}
    run = create_run(platform_user[0], "crashes", config)
    run = wait_for(
        lambda: Run.objects.filter(pk=run.pk, state__in=states.TERMINAL).first(), timeout=180, message="the crash"
    )
    attempt = run.attempts.get()
    assert run.state == states.FAILED and attempt.exit_code not in (None, 0)
    assert "rank 1 failed first: InjectedFault: injected fault: rank 1 crashes at step 3" in attempt.failure_reason
    # A Python exception in the training code would happen again: no automatic restart.
    assert (attempt.failure_kind, attempt.retryable) == ("exception", False)
    assert attempt.restart_decision == "not restarted: a failure of kind 'exception' would happen again"
    assert max(metric_steps(run, 0), default=0) <= 2
    logs = run.events.filter(kind="log", rank=1, payload__level="ERROR")
    assert any("injected fault" in event.payload["message"] for event in logs)


def test_cancelling_a_run_with_a_hung_rank_leaves_no_rank_behind(live_platform, platform_user):
    """torchrun starts each rank in a session of its own and waits 30 s before it SIGKILLs a rank that
    ignores SIGTERM; the launcher's grace is shorter, so it must find and kill the ranks itself."""
    from loom.runs.backends.process_tree import descendants
    from loom.runs.services import cancel_run, create_run

    run = create_run(platform_user[0], "hangs", {**TINY_CONFIG, "faults": {"hang_at_step": 3, "hang_rank": 1}})
    wait_for(lambda: 2 in metric_steps(run, 0), timeout=120, message="step 2")
    running = run.events.get(kind="state", rank=-1, payload__state=states.RUNNING)
    ranks = wait_for(lambda: descendants(running.payload["pid"]), timeout=10, message="the ranks' processes")
    cancel_run(run)
    run = wait_for(
        lambda: Run.objects.filter(pk=run.pk, state__in=states.TERMINAL).first(), timeout=60, message="the cancel"
    )
    assert run.state == states.CANCELLED
    wait_for(lambda: not any(running_process(pid) for pid in ranks), timeout=10, message="every rank to be gone")


def running_process(pid: int) -> bool:
    """Whether pid is a live process (a zombie waiting for its parent counts as gone)."""
    from loom.runs.backends.process_tree import stat_fields

    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def lifecycle_states(run: Run) -> list[str]:
    """The states the platform (rank null: queued, the claim's starting) and the launcher (rank -1: running, the
    end) recorded, in the order they were stored. Both may tell one move (the reconciler sees torchrun running
    as its supervisor reports it): a state told again right after itself counts once."""
    events = run.events.filter(Q(rank__isnull=True) | Q(rank=-1), kind="state").order_by("seq")
    told = [event.payload["state"] for event in events]
    return [state for index, state in enumerate(told) if index == 0 or state != told[index - 1]]
