"""Naming the rank a hung run waits for, from the ranks' collective progress (pure)."""

from loom.alerts.culprits import find_culprits

SETTLE_S = 5.0


def snapshot(groups=(), peers=(), waiting=None, quiet_s=60.0) -> dict:
    return {
        "groups": [{"ranks": list(ranks), "issued": issued} for ranks, issued in groups],
        "peers": [{"peer": peer, "sent": sent, "received": received} for peer, sent, received in peers],
        "waiting": None if waiting is None else {"op": waiting[0], "ranks": list(waiting[1]), "for_s": quiet_s},
        "quiet_s": quiet_s,
    }


def named(verdict) -> list[int]:
    return [suspect.rank for suspect in verdict.culprits]


def test_in_step_ranks_name_nobody():
    progress = {rank: snapshot(groups=[((0, 1), 9)]) for rank in (0, 1)}
    verdict = find_culprits(progress, SETTLE_S)
    assert named(verdict) == [] and verdict.describe() == ""


def test_the_rank_that_never_issued_the_collective_its_group_waits_in_is_named():
    tp, dp = (0, 1), (1, 3)
    progress = {
        0: snapshot(groups=[(tp, 12), ((0, 2), 5)], waiting=("all_gather", tp)),
        1: snapshot(groups=[(tp, 11), (dp, 4)]),
        2: snapshot(groups=[((2, 3), 12), ((0, 2), 5)]),
        3: snapshot(groups=[((2, 3), 12), (dp, 5)], waiting=("all_reduce", dp)),
    }
    verdict = find_culprits(progress, SETTLE_S)
    assert named(verdict) == [1]
    (suspect,) = verdict.culprits
    # Behind in both of its groups: both pieces of evidence, the tp group's first.
    assert suspect.evidence == (
        "it issued 11 collectives on ranks [0, 1], rank 0 issued 12",
        "it issued 4 collectives on ranks [1, 3], rank 3 issued 5",
    )
    assert verdict.describe().startswith("rank 1 is the one the others wait for: it issued 11 collectives")
    assert verdict.describe({1: "node-b", 0: "node-a"}).startswith("rank 1 (on node-b) is the one")
    assert "(waiting: ranks 0, 3 in all_gather on ranks [0, 1] for 60 s)" in verdict.describe()


def test_a_pipeline_stage_that_never_sent_is_named_by_its_neighbour_waiting_to_receive():
    world = (0, 1, 2, 3)
    progress = {
        0: snapshot(peers=[(1, 6, 6)], waiting=None),
        1: snapshot(peers=[(0, 6, 6), (2, 5, 5)], waiting=None),
        2: snapshot(peers=[(1, 5, 6), (3, 5, 5)], waiting=("recv", world)),
        3: snapshot(peers=[(2, 5, 5)], waiting=("recv", world)),
    }
    verdict = find_culprits(progress, SETTLE_S)
    assert named(verdict) == [1]
    assert verdict.culprits[0].evidence == ("it sent rank 2 5 messages, rank 2 waits for 6",)


def test_a_send_nobody_receives_names_the_receiver():
    progress = {0: snapshot(peers=[(1, 4, 0)], waiting=("send", (0, 1))), 1: snapshot(peers=[(0, 0, 3)])}
    assert named(find_culprits(progress, SETTLE_S)) == [1]


def test_progress_that_has_not_settled_is_no_evidence():
    progress = {
        0: snapshot(groups=[((0, 1), 8)], waiting=("all_reduce", (0, 1)), quiet_s=0.02),
        1: snapshot(groups=[((0, 1), 7)], quiet_s=0.02),
    }
    assert named(find_culprits(progress, SETTLE_S)) == []
    # Nor is a group whose members have not all reported.
    assert named(find_culprits({0: progress[0] | {"quiet_s": 60.0}}, SETTLE_S)) == []


def test_when_every_rank_behind_also_waits_they_are_all_named():
    """Collectives issued in different orders: each waits in a group the other is behind in."""
    progress = {
        0: snapshot(groups=[((0, 1), 3), ((0, 2), 2)], waiting=("all_reduce", (0, 1))),
        1: snapshot(groups=[((0, 1), 2)], waiting=("broadcast", (1,))),
        2: snapshot(groups=[((0, 2), 3)], waiting=("all_reduce", (0, 2))),
    }
    verdict = find_culprits(progress, SETTLE_S)
    assert named(verdict) == [0, 1]
    assert verdict.describe().startswith("ranks 0, 1 are the ones the others wait for")
