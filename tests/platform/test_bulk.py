"""The stage tables ingest's bulk writes go through: a use sees only its own rows, whatever the
transactions before it did, and on PostgreSQL a stage costs no statements of its own once it exists;
and a group commit on PostgreSQL, which waits on the database a fixed few times whatever its size."""

import itertools
import tempfile
import time

import pytest
from django.db import connection, transaction

from loom.telemetry import bulk, store
from loom.telemetry.models import RankStep
from loom.telemetry.services import AttemptRef, pending_batch

from .helpers import claimed_run

PROBE = bulk.Table("telemetry_probe", (("value", "bigint"),))
MEASURES = bulk.Table("telemetry_measures", (("value", "float8"),))


def staged_values(rows: list[tuple]) -> list[int]:
    with bulk.staged(PROBE, rows) as stage, connection.cursor() as cursor:
        cursor.execute(f"SELECT value FROM {stage} ORDER BY value")
        return [value for (value,) in cursor.fetchall()]


@pytest.mark.django_db(transaction=True)
def test_a_stage_holds_only_the_rows_of_its_own_use():
    with transaction.atomic():
        assert staged_values([(1,), (2,)]) == [1, 2]
        # Twice in one transaction: the first use's rows are gone.
        assert staged_values([(3,)]) == [3]
    assert staged_values([(4,)]) == [4]
    # On a fresh connection, the transaction that created the stage rolls back: the table goes with it.
    connection.close()
    with pytest.raises(RuntimeError, match="rolled back"), transaction.atomic():
        assert staged_values([(5,)]) == [5]
        raise RuntimeError("rolled back")
    assert staged_values([(6,), (7,)]) == [6, 7]
    # A later transaction that filled it rolls back: its rows go, the stage stays.
    with pytest.raises(RuntimeError, match="rolled back"), transaction.atomic():
        staged_values([(8,)])
        raise RuntimeError("rolled back")
    assert staged_values([(9,)]) == [9]


@pytest.mark.django_db(transaction=True)
def test_once_a_stage_exists_a_use_adds_no_statement_of_its_own_on_postgresql():
    staged_values([(1,)])
    statements = []

    def record(execute, sql, params, many, context):
        statements.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        assert staged_values([(2,)]) == [2]
    housekeeping = [sql for sql in statements if sql.startswith(("CREATE TEMP", "DELETE FROM stage_"))]
    # PostgreSQL creates it once per connection and empties it at each commit; SQLite is asked each time.
    assert len(housekeeping) == (0 if connection.vendor == "postgresql" else 2)


@pytest.mark.django_db(transaction=True)
def test_a_float_column_takes_whole_numbers_among_its_values():
    with transaction.atomic(), bulk.staged(MEASURES, [(1,), (2.5,), (None,)]) as stage, connection.cursor() as cursor:
        cursor.execute(f"SELECT value FROM {stage} ORDER BY value NULLS LAST")
        assert [value for (value,) in cursor.fetchall()] == [1.0, 2.5, None]


def rank_batches(attempt, count: int, seq: int) -> list[store.PendingBatch]:
    """`count` ranks' batches number `seq` as a trainer sends them: two steps' metrics and heartbeats, and
    a comm row."""
    ref = AttemptRef(attempt.pk, attempt.number, attempt.run_id, count, finished_at=None, read_at=time.monotonic())
    batches = []
    for rank in range(count):
        events = []
        for step in (2 * seq + 1, 2 * seq + 2):
            events.append({"kind": "metric", "time": time.time(), "step": step, "payload": {"step_time_s": 0.5}})
            events.append({"kind": "heartbeat", "time": time.time(), "step": step, "payload": {"host": "node-0"}})
        events.append({"kind": "comm", "time": time.time(), "step": step, "payload": {"sends": {"1": {"bytes": 8}}}})
        batches.append(pending_batch(ref, rank, seq, events))
    return batches


def answers_waited_for(write) -> int:
    """How many times `write` waited on PostgreSQL for an answer: the turns in libpq's own trace of the
    protocol from messages the client sent to messages the server sent back."""
    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    with tempfile.TemporaryFile(mode="w+") as trace:
        pgconn.trace(trace.fileno())
        try:
            write()
        finally:
            pgconn.untrace()
        trace.seek(0)
        # Each line: [timestamp] direction (F from the client, B from the server) length message ...
        directions = [next(field for field in line.split("\t") if field in ("F", "B")) for line in trace]
    return sum(1 for sent, answered in itertools.pairwise(directions) if (sent, answered) == ("F", "B"))


@pytest.mark.skipif(connection.vendor != "postgresql", reason="pipelining is PostgreSQL's; SQLite has no round trips")
@pytest.mark.django_db(transaction=True)
def test_a_group_commit_waits_on_postgresql_only_for_the_answers_it_needs(platform_user):
    """For the BEGIN psycopg sends first, the keys it claimed, the seq numbers it took, the end of its
    pipeline and its commit: not once per statement, and not more for more batches."""
    run, attempt, _ = claimed_run(platform_user[0])
    small, large = rank_batches(attempt, 3, seq=0), rank_batches(attempt, 40, seq=1)
    waits = [answers_waited_for(lambda batches=batches: store.store_batches(batches)) for batches in (small, large)]
    assert waits[0] == waits[1] <= 5, waits
    assert run.events.filter(rank__gte=0).count() == 43 * 5
    assert RankStep.objects.filter(attempt=attempt).count() == 43 * 2
