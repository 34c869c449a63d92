"""Which rank a hung run waits for, from every rank's collective progress (trainer/collective_progress.py).

Ranks of a group issue the group's collectives in the same order, so in a hang the ranks that reached
the next collective show one more issued than the rank that never did; a rank that has posted more
receives from a peer than that peer has sent waits for the peer. The ranks found behind that are not
themselves waiting in an op are stuck outside every collective (a loop, a data loader, a deadlock of
their own): they are the culprits. If every rank behind also waits (collectives issued in different
orders, a chain of pipeline stages), they are all named.

Only progress that has settled counts: a rank's counts are read once nothing has moved on it for
settle_s, so a heartbeat sent mid-step (when counts differ for a moment) is never taken for a hang.
Pure: no database, no Django.
"""

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Suspect:
    rank: int
    evidence: tuple[str, ...]
    waiting: bool


@dataclass(frozen=True)
class Verdict:
    culprits: tuple[Suspect, ...]
    # rank → "all_reduce on ranks [0, 1, 2, 3] for 41 s"
    waits: dict[int, str] = field(default_factory=dict)

    def describe(self, hosts: dict[int, str] | None = None) -> str:
        """One sentence for the alert, naming each culprit's host where known; empty when nobody could be named."""
        if not self.culprits:
            return ""
        hosts = hosts or {}
        several = len(self.culprits) > 1
        named = _ranks([suspect.rank for suspect in self.culprits])
        on = sorted({hosts[suspect.rank] for suspect in self.culprits if hosts.get(suspect.rank)})
        lead = named + (f" (on {', '.join(on)})" if on else "")
        lead += f" {'are the ones' if several else 'is the one'} the others wait for: "
        lead += "; ".join(self.culprits[0].evidence)
        waiting = sorted(rank for rank in self.waits if rank not in {suspect.rank for suspect in self.culprits})
        if waiting:
            lead += f" (waiting: {_ranks(waiting)} in {self.waits[waiting[0]]})"
        return lead


def find_culprits(progress: dict[int, dict], settle_s: float) -> Verdict:
    """`progress`: rank → its latest heartbeat's collective progress (ranks that sent none are left out)."""
    settled = {rank: snapshot for rank, snapshot in progress.items() if snapshot.get("quiet_s", 0) >= settle_s}
    evidence: dict[int, list[str]] = defaultdict(list)
    _compare_groups(settled, evidence)
    _compare_peers(settled, evidence)
    waits = {rank: _wait_text(snapshot["waiting"]) for rank, snapshot in settled.items() if snapshot.get("waiting")}
    suspects = [Suspect(rank, tuple(reasons), rank in waits) for rank, reasons in evidence.items()]
    stuck_outside = [suspect for suspect in suspects if not suspect.waiting]
    named = stuck_outside or suspects
    named.sort(key=lambda suspect: (-len(suspect.evidence), suspect.rank))
    return Verdict(tuple(named), waits)


def _compare_groups(settled: dict[int, dict], evidence: dict[int, list[str]]) -> None:
    issued: dict[tuple[int, ...], dict[int, int]] = defaultdict(dict)
    for rank, snapshot in settled.items():
        for group in snapshot.get("groups", []):
            issued[tuple(group["ranks"])][rank] = group["issued"]
    for group, counts in issued.items():
        if len(counts) < len(group):
            continue  # a member's progress is not settled (or not reported): no verdict on this group yet
        most = max(counts.values())
        ahead = sorted(rank for rank, count in counts.items() if count == most)
        for rank, count in counts.items():
            if count < most:
                evidence[rank].append(
                    f"it issued {count} collectives on ranks {list(group)}, {_ranks(ahead)} issued {most}"
                )


def _compare_peers(settled: dict[int, dict], evidence: dict[int, list[str]]) -> None:
    counts = {
        rank: {entry["peer"]: (entry["sent"], entry["received"]) for entry in snapshot.get("peers", [])}
        for rank, snapshot in settled.items()
    }
    for rank, peers in counts.items():
        for peer, (_, received) in peers.items():
            if peer not in counts:
                continue
            sent_by_peer, received_by_peer = counts[peer].get(rank, (0, 0))
            if received > sent_by_peer:
                evidence[peer].append(f"it sent rank {rank} {sent_by_peer} messages, rank {rank} waits for {received}")
            if peers[peer][0] > received_by_peer:
                evidence[peer].append(
                    f"it posted {received_by_peer} receives from rank {rank}, which sent {peers[peer][0]}"
                )


def _wait_text(waiting: dict) -> str:
    return f"{waiting['op']} on ranks {waiting['ranks']} for {waiting['for_s']:.0f} s"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(rank) for rank in ranks)
