"""How far each rank has got through its collectives, for naming the rank a hung run waits for.

Every rank of a process group issues that group's collectives in the same order, so the number each has
issued is the same whenever they are in step. When a run hangs, the ranks that reached the next
collective wait in it, and the one that never issued it (stuck in compute, in a data loader, in a
deadlock of its own) shows a smaller count: that comparison, made by the platform across every rank's
heartbeat, names it. Point-to-point traffic is counted per peer: a rank that has posted more receives from a
peer than the peer has sent waits for that peer.

Only ops issued while the collective capture keeps them are counted; every rank keeps the same ones.
"""

import threading
import time
from collections import Counter
from dataclasses import dataclass

SEND = "send"
RECV = "recv"
# Completed ops are dropped from the pending list when a snapshot is taken, or once it grows this long; of
# those still pending, at most half as many are kept, the newest (an op nobody waits on never completes, and
# while a run hangs no new op comes to push out the one it waits in).
PRUNE_AT = 4096


@dataclass(frozen=True)
class _Pending:
    op: str
    group: tuple[int, ...]
    timing: object  # comm._Timing: issued_at, in_flight, and completed_at once the op completes


class CollectiveProgress:
    """Per-group issue counts, per-peer send/receive counts and the ops still in flight, from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._issued: Counter[tuple[int, ...]] = Counter()
        self._sent: Counter[int] = Counter()
        self._received: Counter[int] = Counter()
        self._pending: list[_Pending] = []
        self._last_activity = time.perf_counter()

    def issued(self, op: str, group: tuple[int, ...], peer: int | None, timing: object) -> None:
        """One op was issued on `group` (global ranks); `peer` is the global rank of a send's or receive's other end."""
        with self._lock:
            if op == SEND:
                self._sent[peer] += 1
            elif op == RECV:
                self._received[peer] += 1
            else:
                self._issued[group] += 1
            self._pending.append(_Pending(op, group, timing))
            self._last_activity = max(self._last_activity, timing.issued_at)
            if len(self._pending) >= PRUNE_AT:
                self._prune()

    def snapshot(self) -> dict:
        """What a heartbeat carries: counts, the oldest op still in flight, and how long nothing has moved."""
        now = time.perf_counter()
        with self._lock:
            self._prune()
            oldest = min(self._pending, key=lambda pending: pending.timing.issued_at, default=None)
            return {
                "groups": [{"ranks": list(group), "issued": count} for group, count in sorted(self._issued.items())],
                "peers": [
                    {"peer": peer, "sent": self._sent[peer], "received": self._received[peer]}
                    for peer in sorted(self._sent.keys() | self._received.keys())
                ],
                "waiting": None
                if oldest is None
                else {
                    "op": oldest.op,
                    "ranks": list(oldest.group),
                    "for_s": round(now - oldest.timing.issued_at, 3),
                },
                "quiet_s": round(now - self._last_activity, 3),
            }

    def _prune(self) -> None:
        still = []
        for pending in self._pending:
            if pending.timing.in_flight:
                still.append(pending)
            elif pending.timing.completed_at is not None:
                self._last_activity = max(self._last_activity, pending.timing.completed_at)
        self._pending = still[-(PRUNE_AT // 2) :]
