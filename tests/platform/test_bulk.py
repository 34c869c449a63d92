"""The stage tables ingest's bulk writes go through: a use sees only its own rows, whatever the
transactions before it did, and on PostgreSQL a stage costs no statements of its own once it exists."""

import pytest
from django.db import connection, transaction

from loom.telemetry import bulk

PROBE = bulk.Table("telemetry_probe", (("value", "bigint"),))


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
