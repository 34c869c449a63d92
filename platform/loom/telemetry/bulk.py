"""Bulk writes for ingest: each table's rows of a group commit in a fixed number of statements.

Rows are first put in a temporary stage table of the connection (COPY on PostgreSQL, whose rows psycopg
formats in C; multi-row VALUES on SQLite, the embedded default) and then moved by one INSERT … SELECT,
which may resolve conflicts, return keys, or aggregate (the heatmap tiles): the statement text never
depends on the number of rows, and no value passes through Python's own formatting. Rows that cannot
conflict (new events) are copied straight into their table.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import psycopg
from django.db import connection, transaction

# Rows per VALUES statement on SQLite: times the widest table's columns, well under its 32,766 variables.
SQLITE_ROWS_PER_STATEMENT = 400


@dataclass(frozen=True)
class Table:
    name: str
    # (column, PostgreSQL type)
    columns: tuple[tuple[str, str], ...]

    @property
    def column_list(self) -> str:
        return ", ".join(name for name, _ in self.columns)


def insert(table: Table, rows: Sequence[tuple], conflict: str = "", returning: str = "") -> list[tuple]:
    """INSERT the rows with `conflict` (an ON CONFLICT clause, where `excluded.` names the new row) and
    `returning` (columns to answer with); the returned rows, in no particular order."""
    if not rows:
        return []
    with staged(table, rows) as stage:
        return insert_from(table, stage, conflict, returning)


@contextmanager
def staged(table: Table, rows: Sequence[tuple]) -> Iterator[str]:
    """The rows in this connection's temporary stage table for `table`, by name, for statements that read
    them. Inside the caller's transaction (or one of its own)."""
    stage = f"stage_{table.name}"
    with transaction.atomic(savepoint=False):
        if connection.vendor == "postgresql":
            _ready_stage(stage, table)
            _copy_rows(stage, table, rows)
            yield stage
            return
        # SQLite's columns get no declared type: its type affinity would turn JSON text like "3" into a number.
        with connection.cursor() as cursor:
            cursor.execute(f"CREATE TEMP TABLE IF NOT EXISTS {stage} ({table.column_list})")
            _insert_values(stage, table, rows)
            yield stage
            cursor.execute(f"DELETE FROM {stage}")


@dataclass
class _Stages:
    """The stage tables one PostgreSQL connection holds, and those its open transaction has filled."""

    raw: object
    created: set[str] = field(default_factory=set)
    filled: set[str] = field(default_factory=set)


def _ready_stage(stage: str, table: Table) -> None:
    """An empty stage, in as few round trips as may be: a group commit's every statement waits on the
    database, and on a busy host each wait costs a scheduling turn. A stage is created ON COMMIT DELETE
    ROWS the first time its connection needs it (asked for again until a commit keeps it: a rollback
    drops a table its transaction created), and emptied only if this transaction filled it before (a
    rollback takes back the rows of its transaction, and a commit empties it)."""
    connection.ensure_connection()
    stages = getattr(connection, "_loom_stages", None)
    if stages is None or stages.raw is not connection.connection:
        stages = connection._loom_stages = _Stages(connection.connection)
    statements = []
    if stage not in stages.created:
        columns = ", ".join(f"{name} {kind}" for name, kind in table.columns)
        statements.append(f"CREATE TEMP TABLE IF NOT EXISTS {stage} ({columns}) ON COMMIT DELETE ROWS")
        transaction.on_commit(lambda: stages.created.add(stage))
    if stage in stages.filled:
        statements.append(f"DELETE FROM {stage}")
    else:
        stages.filled.add(stage)
        transaction.on_commit(lambda: stages.filled.discard(stage))
    if statements:
        with connection.cursor() as cursor:
            cursor.execute("; ".join(statements))


def insert_from(table: Table, stage: str, conflict: str = "", returning: str = "") -> list[tuple]:
    """INSERT every staged row into `table`, as insert() does."""
    tail = f" {conflict}" if conflict else ""
    tail += f" RETURNING {returning}" if returning else ""
    with connection.cursor() as cursor:
        # WHERE true: SQLite would otherwise read ON CONFLICT as the start of a join constraint.
        cursor.execute(
            f"INSERT INTO {table.name} ({table.column_list}) SELECT {table.column_list} FROM {stage} WHERE true{tail}"
        )
        return [tuple(row) for row in cursor.fetchall()] if returning else []


def copy(table: Table, rows: Sequence[tuple]) -> None:
    """Append rows no constraint can refuse; COPY on PostgreSQL."""
    if connection.vendor != "postgresql":
        _insert_values(table.name, table, rows)
        return
    _copy_rows(table.name, table, rows)


def _copy_rows(target: str, table: Table, rows: Sequence[tuple]) -> None:
    connection.ensure_connection()
    # A cursor of Django's connection, so in its transaction: Django's own cursors have no COPY.
    with psycopg.Cursor(connection.connection) as cursor:
        with cursor.copy(f"COPY {target} ({table.column_list}) FROM STDIN") as out:
            for row in rows:
                out.write_row(row)


def _insert_values(target: str, table: Table, rows: Sequence[tuple]) -> None:
    placeholders = "(" + ", ".join(["%s"] * len(table.columns)) + ")"
    with connection.cursor() as cursor:
        for start in range(0, len(rows), SQLITE_ROWS_PER_STATEMENT):
            chunk = rows[start : start + SQLITE_ROWS_PER_STATEMENT]
            cursor.execute(
                f"INSERT INTO {target} ({table.column_list}) VALUES {', '.join([placeholders] * len(chunk))}",
                [value for row in chunk for value in row],
            )
