"""Fan-out of stored events to the run's websocket group, coalesced per process (fanout.py)."""

import asyncio
import threading
import time

from channels.layers import get_channel_layer
from django.conf import settings

from .fanout import Coalescer


def run_group(run_id: int) -> str:
    return f"run.{run_id}"


class GroupSender:
    """Sends a run's events to its group on an event loop kept for the process's life. channels_redis keeps
    its Redis connections per event loop: async_to_sync, called from the fan-out thread, would start a
    thread and a loop for each message and connect to Redis again each time (ten times a second per run)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def __call__(self, run_id: int, events: list[dict]) -> None:
        """`sent` (wall-clock seconds) lets a page tell how long its events took after they left the platform."""
        message = {"type": "run.events", "events": events, "sent": time.time()}
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(get_channel_layer().group_send(run_group(run_id), message))


send_to_group = GroupSender()

# One per process: the platform's settings decide how often a run's pages may hear from it.
_coalescer = Coalescer(send_to_group, settings.LOOM_FANOUT_INTERVAL_S)


def publish(run_id: int, events: list[dict]) -> None:
    """Fan events out to the run's websocket group, coalesced with others stored within the interval.
    Loss here is repaired by the page's resync."""
    _coalescer.add(run_id, events)
