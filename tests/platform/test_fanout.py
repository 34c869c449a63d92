"""Coalesced fan-out: a burst from many senders reaches a run's pages as a few messages holding everything."""

import math
import threading
import time

import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings

from loom.telemetry.fanout import Coalescer
from loom.telemetry.publish import GroupSender, run_group

INTERVAL_S = 0.05


class Recorder:
    def __init__(self):
        self.messages: list[tuple[int, list[dict]]] = []
        self.lock = threading.Lock()

    def __call__(self, run_id, events):
        with self.lock:
            self.messages.append((run_id, list(events)))

    def seqs(self, run_id):
        return [event["seq"] for rid, events in self.messages if rid == run_id for event in events]


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the coalescer did not deliver in time"
        time.sleep(0.01)


def test_a_burst_from_many_senders_arrives_whole_in_few_messages_per_interval():
    recorder = Recorder()
    coalescer = Coalescer(recorder, INTERVAL_S)
    senders, batches = 16, 40
    started = time.monotonic()

    def sender(rank):
        for index in range(batches):
            seq = rank * batches + index + 1  # the platform hands seqs out; here each is unique
            coalescer.add(7, [{"seq": seq, "rank": rank}])
            coalescer.add(8, [{"seq": seq, "rank": rank}])

    threads = [threading.Thread(target=sender, args=(rank,)) for rank in range(senders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sent_for = time.monotonic() - started
    total = senders * batches
    wait_until(lambda: len(recorder.seqs(7)) == total and len(recorder.seqs(8)) == total)
    for run_id in (7, 8):
        assert sorted(recorder.seqs(run_id)) == list(range(1, total + 1))  # every event once
        messages = [events for rid, events in recorder.messages if rid == run_id]
        for events in messages:
            assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
        # One message per interval while the burst lasted, plus the one after it.
        assert len(messages) <= math.ceil(sent_for / INTERVAL_S) + 2 < total


def test_the_first_event_after_a_quiet_spell_is_sent_without_waiting_for_company():
    recorder = Recorder()
    coalescer = Coalescer(recorder, interval_s=3600)
    coalescer.add(1, [{"seq": 1}])
    wait_until(lambda: recorder.messages)
    coalescer.add(1, [{"seq": 2}])
    time.sleep(0.2)
    assert recorder.messages == [(1, [{"seq": 1}])]  # the second waits for the hour's interval
    coalescer.flush()
    assert recorder.messages[-1] == (1, [{"seq": 2}])


def test_a_failing_send_is_logged_and_later_events_still_go_out(caplog):
    sent = []

    def flaky(run_id, events):
        if not sent:
            sent.append("failed")
            raise ConnectionError("redis away")
        sent.append(events)

    coalescer = Coalescer(flaky, INTERVAL_S)
    coalescer.add(1, [{"seq": 1}])
    wait_until(lambda: sent)
    coalescer.add(1, [{"seq": 2}])
    wait_until(lambda: len(sent) == 2)
    assert sent[1] == [{"seq": 2}]
    assert "pages will resync" in caplog.text


def redis_connections_received() -> int:
    """Connections the Redis server has accepted since it started; 0 on the in-memory channel layer."""
    if not settings.REDIS_URL:
        return 0
    return redis.Redis.from_url(settings.REDIS_URL).info("stats")["total_connections_received"]


def test_the_group_sender_delivers_every_message_in_order_over_one_kept_connection():
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(run_group(9), channel)
    sender, messages = GroupSender(), 20
    before = redis_connections_received()
    # The coalescer's thread is the one that sends.
    thread = threading.Thread(target=lambda: [sender(9, [{"seq": seq}]) for seq in range(1, messages + 1)])
    thread.start()
    thread.join()
    opened = redis_connections_received() - before

    async def receive_all():
        # One event loop for every receive: channels_redis buffers a channel's messages per loop.
        return [await layer.receive(channel) for _ in range(messages)]

    received = async_to_sync(receive_all)()
    async_to_sync(layer.group_discard)(run_group(9), channel)
    assert [message["events"] for message in received] == [[{"seq": seq}] for seq in range(1, messages + 1)]
    assert all(message["type"] == "run.events" and message["sent"] > 0 for message in received)
    # A connection per message before: 20. The test's own INFO connection is one of those counted.
    assert opened <= 3
