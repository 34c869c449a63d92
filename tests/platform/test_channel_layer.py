"""The product's Redis channel layer: a cancelled receive ends, whenever the cancel lands (a page closing its
websocket cancels its consumer's receive)."""

import asyncio
import random
import time

import pytest
from django.conf import settings

from loom.channel_layer import RedisChannelLayer

pytestmark = pytest.mark.skipif(not settings.REDIS_URL, reason="the Redis channel layer needs REDIS_URL")

RECEIVES = 300
# channels_redis' own receive misses about one cancel in 60 here: in 300 it almost surely misses one.
CANCEL_WITHIN_S = 0.05
ENDED_WITHIN_S = 2.0


def test_every_cancelled_receive_ends_and_a_live_one_still_gets_its_message():
    async def scenario():
        layer = RedisChannelLayer(
            hosts=[{"address": settings.REDIS_URL, "socket_timeout": settings.CHANNEL_LAYER_READ_TIMEOUT_S}],
            prefix=f"cancel-{time.monotonic_ns()}",
        )
        still_running = []
        for _ in range(RECEIVES):
            channel = await layer.new_channel()
            receive = asyncio.ensure_future(layer.receive(channel))
            await asyncio.sleep(random.uniform(0, CANCEL_WITHIN_S))
            receive.cancel()
            await asyncio.wait([receive], timeout=ENDED_WITHIN_S)
            if not receive.done():
                still_running.append(receive)
        channel = await layer.new_channel()
        receive = asyncio.ensure_future(layer.receive(channel))
        await layer.send(channel, {"type": "run.events", "events": [{"seq": 1}]})
        message = await asyncio.wait_for(receive, 10)
        for task in still_running:
            task.cancel()
        await layer.flush()
        return still_running, message

    still_running, message = asyncio.run(scenario())
    assert still_running == []
    assert message["events"] == [{"seq": 1}]
