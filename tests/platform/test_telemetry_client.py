"""The trainer's telemetry client against the real ingest API under uvicorn."""

import json
import time

from loom.telemetry.models import IngestBatch
from trainer.telemetry import TelemetryClient, deliver_spool

from ..conftest import wait_for
from .helpers import claimed_run

FLUSH_S = 0.05


def emit_in_two_batches(client: TelemetryClient) -> None:
    client.emit("metric", {"loss": 2.0}, step=1)
    time.sleep(FLUSH_S * 6)
    client.emit("metric", {"loss": 1.0}, step=2)


def test_client_delivers_every_batch_once_and_empties_its_spool(platform_server, platform_user, tmp_path):
    run, attempt, token = claimed_run(platform_user[0])
    client = TelemetryClient(platform_server.url, token, attempt.pk, 0, tmp_path, FLUSH_S, None)
    emit_in_two_batches(client)
    assert client.close(timeout_s=10) == 0
    assert not list((tmp_path / "rank0").glob("*.json"))
    metrics = run.events.filter(kind="metric", rank=0).order_by("seq")
    assert [(e.step, e.payload["loss"]) for e in metrics] == [(1, 2.0), (2, 1.0)]
    seqs = sorted(IngestBatch.objects.filter(attempt=attempt, rank=0).values_list("seq", flat=True))
    assert seqs == list(range(len(seqs))) and len(seqs) >= 2


def test_a_wrong_token_sets_batches_aside_and_says_so(platform_server, platform_user, tmp_path, capsys):
    run, attempt, _ = claimed_run(platform_user[0])
    client = TelemetryClient(platform_server.url, "attempt_forged", attempt.pk, 0, tmp_path, FLUSH_S, None)
    emit_in_two_batches(client)
    assert client.close(timeout_s=10) == 0
    rejected = sorted((tmp_path / "rejected").glob("*.json"))
    assert [json.loads(p.read_text())["events"][0]["step"] for p in rejected] == [1, 2]
    assert "HTTP 401" in capsys.readouterr().err
    assert not run.events.filter(rank=0).exists()


def test_a_foreign_batch_is_set_aside_while_the_attempts_own_ranks_still_deliver(
    platform_server, platform_user, other_user, tmp_path, capsys
):
    run, attempt, token = claimed_run(platform_user[0])
    foreign_run, foreign_attempt, _ = claimed_run(other_user, "foreign")
    for rank, attempt_id in ((0, foreign_attempt.pk), (1, attempt.pk)):
        offline = TelemetryClient(None, None, attempt_id, rank, tmp_path, FLUSH_S, None)
        offline.emit("metric", {"loss": 1.5}, step=7)
        offline.close(timeout_s=5)
    assert deliver_spool(tmp_path, platform_server.url, token, deadline_s=10) == 0
    assert "HTTP 403" in capsys.readouterr().err
    assert len(list((tmp_path / "rejected").glob("rank0-*.json"))) == 1
    assert not foreign_run.events.filter(kind="metric").exists()
    assert list(run.events.filter(kind="metric").values_list("rank", "step")) == [(1, 7)]


def test_a_clients_batches_share_one_kept_alive_connection(platform_server, platform_user, tmp_path):
    run, attempt, token = claimed_run(platform_user[0])
    state = platform_server.server.server_state
    requests_before = state.total_requests
    client = TelemetryClient(platform_server.url, token, attempt.pk, 0, tmp_path, FLUSH_S, None)
    for step in range(1, 4):
        client.emit("metric", {"loss": 1.0 / step}, step=step)
        time.sleep(FLUSH_S * 6)
    wait_for(lambda: not list((tmp_path / "rank0").glob("*.json")), timeout=10, message="every batch delivered")
    batches = IngestBatch.objects.filter(attempt=attempt, rank=0).count()
    assert batches >= 3 and state.total_requests - requests_before == batches
    # Still open between batches: the one connection the server holds is the client's.
    assert len(state.connections) == 1
    client.close(timeout_s=10)
    wait_for(lambda: not state.connections, timeout=5, message="the connection closed with the client")
    assert [e.step for e in run.events.filter(kind="metric").order_by("seq")] == [1, 2, 3]


def test_a_connection_the_server_closed_while_idle_is_replaced_without_a_failed_send(
    platform_server, platform_user, tmp_path, capsys
):
    run, attempt, token = claimed_run(platform_user[0])
    state = platform_server.server.server_state
    client = TelemetryClient(platform_server.url, token, attempt.pk, 0, tmp_path, FLUSH_S, None)
    client.emit("metric", {"loss": 2.0}, step=1)
    wait_for(lambda: run.events.filter(kind="metric").exists(), timeout=10, message="the first batch stored")
    wait_for(lambda: len(state.connections) == 1, timeout=5, message="the kept-alive connection")
    # As at the server's keep-alive timeout: it closes the idle connection under the client.
    (connection,) = state.connections
    connection.loop.call_soon_threadsafe(connection.shutdown)
    wait_for(lambda: not state.connections, timeout=5, message="the server closed it")
    client.emit("metric", {"loss": 1.0}, step=2)
    assert client.close(timeout_s=10) == 0
    assert [e.step for e in run.events.filter(kind="metric").order_by("seq")] == [1, 2]
    assert "cannot deliver" not in capsys.readouterr().err
