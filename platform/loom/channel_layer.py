"""channels_redis' channel layer, with a receive that ends when it is cancelled.

channels_redis receives by popping the channel's Redis list (BZPOPMIN, blocking 5 s) until a message comes.
A cancel that lands as one pop returns can be lost: the receive then pops again, and again, for good (about
1 cancel in 60 on this machine). A page closing its websocket cancels its consumer's receive, so every
closed page could leave such a loop behind, each holding a Redis connection, and the web process waits on
them when it is told to stop. The receive here runs the library's in a task of its own and, once cancelled,
cancels that task until it has ended.
"""

import asyncio

from channels_redis.core import RedisChannelLayer as LibraryRedisChannelLayer

from loom.operations.metrics import RECEIVER_CLOSED, fanout_dropped_messages

# How long a cancelled receive is given to end before it is cancelled again.
CANCEL_AGAIN_AFTER_S = 0.1


class RedisChannelLayer(LibraryRedisChannelLayer):
    async def receive(self, channel):
        popping = asyncio.ensure_future(super().receive(channel))
        try:
            return await asyncio.shield(popping)
        except asyncio.CancelledError:
            # A message popped in the same instant is dropped with the consumer that asked for it; the page
            # that reconnects fills the gap from the REST API.
            while not popping.done():
                popping.cancel()
                await asyncio.wait([popping], timeout=CANCEL_AGAIN_AFTER_S)
            if not popping.cancelled() and popping.exception() is None:
                fanout_dropped_messages.labels(RECEIVER_CLOSED).inc()
            raise
