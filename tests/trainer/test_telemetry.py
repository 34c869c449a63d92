import json
import logging
import math
import socket
import time
from pathlib import Path

import pytest

from trainer.telemetry import (
    MAX_BATCH_BYTES,
    MAX_BATCH_EVENTS,
    TelemetryClient,
    TelemetryLogHandler,
    deliver_spool,
    read_spool,
    split_batches,
)

FLUSH_S = 0.05


def offline_client(spool_dir: Path, rank: int = 0, heartbeat_interval_s: float | None = None) -> TelemetryClient:
    return TelemetryClient(None, None, None, rank, spool_dir, FLUSH_S, heartbeat_interval_s)


def closed_port_url() -> str:
    """A local port nothing listens on: connecting is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def events_of(batches: list[dict]) -> list[dict]:
    return [event for batch in batches for event in batch["events"]]


def spooled_files(spool_dir: Path, rank: int = 0) -> list[str]:
    return sorted(path.name for path in (spool_dir / f"rank{rank}").glob("*.json"))


def test_offline_client_keeps_every_event_on_disk(tmp_path):
    client = offline_client(tmp_path)
    assert client.emit("state", {"state": "started"})
    for step in range(1, 6):
        client.emit("metric", {"loss": 1.0 / step}, step=step)
    client.emit("log", {"level": "INFO", "message": "hello", "logger": "test"})
    before = time.time()
    remaining = client.close(timeout_s=5)

    batches = read_spool(tmp_path)
    assert remaining == len(batches) >= 1
    assert all(batch["attempt"] is None and batch["rank"] == 0 for batch in batches)
    events = events_of(batches)
    assert [event["kind"] for event in events] == ["state"] + ["metric"] * 5 + ["log"]
    assert [event["step"] for event in events] == [None, 1, 2, 3, 4, 5, None]
    assert events[3]["payload"] == {"loss": 1.0 / 3}
    assert all(isinstance(event["time"], float) and event["time"] <= before for event in events)


def test_seq_numbers_continue_across_batches_and_a_recreated_client(tmp_path):
    client = offline_client(tmp_path)
    for step in range(3):
        client.emit("metric", {"step": step}, step=step)
        time.sleep(FLUSH_S * 4)
    client.close(timeout_s=5)
    first_seqs = [batch["seq"] for batch in read_spool(tmp_path)]
    assert len(first_seqs) >= 2
    assert first_seqs == list(range(len(first_seqs)))

    recreated = offline_client(tmp_path)
    recreated.emit("metric", {"step": 3}, step=3)
    recreated.close(timeout_s=5)
    batches = read_spool(tmp_path)
    assert [batch["seq"] for batch in batches] == list(range(len(first_seqs) + 1))
    assert [event["step"] for event in events_of(batches)] == [0, 1, 2, 3]


def test_a_recreated_client_does_not_reuse_seqs_whose_batches_were_delivered(tmp_path):
    client = offline_client(tmp_path)
    client.emit("metric", {"loss": 1.0}, step=1)
    client.close(timeout_s=5)
    for path in (tmp_path / "rank0").glob("*.json"):
        path.unlink()

    recreated = offline_client(tmp_path)
    recreated.emit("metric", {"loss": 0.5}, step=2)
    recreated.close(timeout_s=5)
    assert [batch["seq"] for batch in read_spool(tmp_path)] == [1]


def test_large_volumes_are_split_into_batches_within_the_limits(tmp_path):
    client = offline_client(tmp_path)
    for index in range(4500):
        client.emit("metric", {"index": index})
    for _ in range(60):
        client.emit("log", {"level": "INFO", "message": "x" * 20_000, "logger": "big"})
    client.close(timeout_s=5)

    paths = sorted((tmp_path / "rank0").glob("*.json"))
    batches = read_spool(tmp_path)
    assert all(len(batch["events"]) <= MAX_BATCH_EVENTS for batch in batches)
    assert all(path.stat().st_size <= MAX_BATCH_BYTES + 100 for path in paths)
    assert len(events_of(batches)) == 4560
    assert [event["payload"].get("index") for event in events_of(batches)[:4500]] == list(range(4500))


def test_split_batches_never_leaves_a_batch_empty():
    events = ["x" * (MAX_BATCH_BYTES + 1), "y", "z"]
    assert list(split_batches(events)) == [[events[0]], ["y", "z"]]
    assert list(split_batches([])) == []


def test_read_spool_orders_batches_by_rank_then_seq(tmp_path):
    for rank in (1, 0):
        client = offline_client(tmp_path, rank=rank)
        client.emit("metric", {"rank": rank}, step=1)
        time.sleep(FLUSH_S * 4)
        client.emit("metric", {"rank": rank}, step=2)
        client.close(timeout_s=5)
    keys = [(batch["rank"], batch["seq"]) for batch in read_spool(tmp_path)]
    assert keys == sorted(keys)
    assert {rank for rank, _ in keys} == {0, 1}


def test_non_finite_numbers_arrive_as_strings_because_bare_nan_is_not_json(tmp_path):
    client = offline_client(tmp_path)
    client.emit("metric", {"loss": math.nan, "grad_norm": math.inf, "nested": [-math.inf, 1.5]}, step=1)
    client.close(timeout_s=5)
    text = next((tmp_path / "rank0").glob("*.json")).read_text()
    json.loads(text, parse_constant=pytest.fail)
    assert events_of(read_spool(tmp_path))[0]["payload"] == {
        "loss": "NaN",
        "grad_norm": "Infinity",
        "nested": ["-Infinity", 1.5],
    }


def test_unknown_kinds_are_refused_and_closed_clients_take_nothing(tmp_path):
    client = offline_client(tmp_path)
    with pytest.raises(ValueError, match="unknown event kind"):
        client.emit("gossip", {})
    client.close(timeout_s=5)
    assert client.emit("metric", {"loss": 1.0}) is False
    assert client.close(timeout_s=5) == 0


def test_heartbeats_are_emitted_on_their_interval_with_the_last_step(tmp_path):
    client = offline_client(tmp_path, heartbeat_interval_s=0.05)
    client.emit("metric", {"loss": 1.0}, step=7)
    time.sleep(0.4)
    client.close(timeout_s=5)
    heartbeats = [event for event in events_of(read_spool(tmp_path)) if event["kind"] == "heartbeat"]
    assert len(heartbeats) >= 3
    assert heartbeats[-1]["step"] == 7
    assert {"pid", "host"} <= set(heartbeats[0]["payload"])


def test_log_records_become_log_events_with_their_traceback(tmp_path):
    client = offline_client(tmp_path)
    logger = logging.getLogger("loom.test.telemetry")
    logger.setLevel(logging.DEBUG)
    handler = TelemetryLogHandler(client)
    logger.addHandler(handler)
    try:
        logger.debug("below the handler's level")
        logger.info("step done", extra={"step": 4})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logger.exception("training failed")
    finally:
        logger.removeHandler(handler)
    client.close(timeout_s=5)

    info, error = events_of(read_spool(tmp_path))
    assert info["kind"] == "log" and info["step"] == 4
    assert info["payload"] == {"level": "INFO", "message": "step done", "logger": "loom.test.telemetry"}
    assert error["payload"]["level"] == "ERROR"
    assert error["payload"]["message"].startswith("training failed\nTraceback")
    assert "RuntimeError: boom" in error["payload"]["message"]


def test_an_unreachable_platform_leaves_batches_spooled_and_close_keeps_its_timeout(tmp_path, capsys):
    client = TelemetryClient(closed_port_url(), "secret-token", 3, 0, tmp_path, FLUSH_S, None)
    for step in range(1, 4):
        client.emit("metric", {"loss": 1.0}, step=step)
    time.sleep(FLUSH_S * 4)
    client.emit("state", {"state": "finished", "steps": 3}, step=3)

    started = time.monotonic()
    remaining = client.close(timeout_s=1.0)
    elapsed = time.monotonic() - started

    assert 0.9 <= elapsed < 2.0
    batches = read_spool(tmp_path)
    assert remaining == len(batches) >= 2
    assert [event["step"] for event in events_of(batches)] == [1, 2, 3, 3]
    assert all(batch["attempt"] == 3 for batch in batches)
    assert "keeping it spooled and retrying" in capsys.readouterr().err


def test_deliver_spool_gives_up_at_its_deadline_and_counts_what_is_left(tmp_path):
    for rank in (0, 1):
        client = offline_client(tmp_path, rank=rank)
        client.emit("metric", {"loss": 1.0}, step=1)
        client.close(timeout_s=5)
    started = time.monotonic()
    assert deliver_spool(tmp_path, closed_port_url(), "secret-token", deadline_s=0.5) == 2
    assert time.monotonic() - started < 1.5


def test_a_steps_metrics_are_cut_at_once_and_then_no_more_than_once_an_interval(tmp_path):
    """Steps slower than the flush interval send each step's metrics as soon as they are made; what comes
    within an interval of the last cut waits for the interval, so a rank still sends at most once per it."""
    interval_s = 60.0
    client = TelemetryClient(None, None, None, 0, tmp_path, interval_s, None)
    try:
        client.emit("metric", {"loss": 2.0}, step=1)
        deadline = time.monotonic() + interval_s / 2
        while not spooled_files(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(spooled_files(tmp_path)) == 1, "the first step's metrics waited for the flush interval"
        client.emit("metric", {"loss": 1.5}, step=2)
        client.emit("log", {"level": "INFO", "message": "between cuts", "logger": "test"})
        time.sleep(0.5)
        assert len(spooled_files(tmp_path)) == 1
    finally:
        client.close(timeout_s=5)
    events = events_of(read_spool(tmp_path))
    assert [(event["kind"], event["step"]) for event in events] == [("metric", 1), ("metric", 2), ("log", None)]
