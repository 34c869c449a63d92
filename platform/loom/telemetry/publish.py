"""Fan-out of stored events to the run's websocket group, coalesced per process (fanout.py)."""

import time

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings

from .fanout import Coalescer


def run_group(run_id: int) -> str:
    return f"run.{run_id}"


def send_to_group(run_id: int, events: list[dict]) -> None:
    """`sent` (wall-clock seconds) lets a page tell how long its events took after they left the platform."""
    message = {"type": "run.events", "events": events, "sent": time.time()}
    async_to_sync(get_channel_layer().group_send)(run_group(run_id), message)


# One per process: the platform's settings decide how often a run's pages may hear from it.
_coalescer = Coalescer(send_to_group, settings.LOOM_FANOUT_INTERVAL_S)


def publish(run_id: int, events: list[dict]) -> None:
    """Fan events out to the run's websocket group, coalesced with others stored within the interval.
    Loss here is repaired by the page's resync."""
    _coalescer.add(run_id, events)
