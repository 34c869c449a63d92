"""Bulk writes for ingest: each table's rows of a group commit in a fixed number of statements.

On PostgreSQL a table's rows travel as one array per column, unnested by one INSERT … SELECT that may
resolve conflicts or return keys, so the statement text never depends on the number of rows and no value
passes through Python's own formatting. Inside `pipelined()` those statements are sent without waiting
for each one's answer: a group commit waits on the database only where it needs an answer (the keys it
claimed, the seq numbers it took) and at the commit, instead of once per statement. On a host whose
cores are busy, every wait costs a scheduling turn of the database and of this thread.

Rows that several statements read (the rank steps, which also feed the heatmap tiles) go once into a
temporary stage table of the connection. SQLite, the embedded default, takes multi-row VALUES.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
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
    if connection.vendor == "postgresql":
        return _insert_arrays(table.name, table, rows, _tail(conflict, returning), bool(returning))
    with staged(table, rows) as stage:
        return insert_from(table, stage, conflict, returning)


def pipelined():
    """A context in which PostgreSQL statements are sent at once and their answers read only when a
    caller asks for one (fetch) or the context ends; raises there what any of them raised."""
    if connection.vendor != "postgresql":
        return nullcontext()
    connection.ensure_connection()
    return connection.connection.pipeline()


@contextmanager
def staged(table: Table, rows: Sequence[tuple]) -> Iterator[str]:
    """The rows in this connection's temporary stage table for `table`, by name, for statements that read
    them. Inside the caller's transaction (or one of its own)."""
    stage = f"stage_{table.name}"
    with transaction.atomic(savepoint=False):
        if connection.vendor == "postgresql":
            _ready_stage(stage, table)
            _insert_arrays(stage, table, rows)
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
    # One statement per execute: a pipeline takes no multi-statement strings.
    with connection.cursor() as cursor:
        for statement in statements:
            cursor.execute(statement)


def insert_from(table: Table, stage: str, conflict: str = "", returning: str = "") -> list[tuple]:
    """INSERT every staged row into `table`, as insert() does."""
    with connection.cursor() as cursor:
        # WHERE true: SQLite would otherwise read ON CONFLICT as the start of a join constraint.
        cursor.execute(
            f"INSERT INTO {table.name} ({table.column_list}) SELECT {table.column_list} FROM {stage} "
            f"WHERE true{_tail(conflict, returning)}"
        )
        return [tuple(row) for row in cursor.fetchall()] if returning else []


def _tail(conflict: str, returning: str) -> str:
    return (f" {conflict}" if conflict else "") + (f" RETURNING {returning}" if returning else "")


def append(table: Table, rows: Sequence[tuple]) -> None:
    """Add rows no constraint can refuse."""
    if not rows:
        return
    if connection.vendor != "postgresql":
        _insert_values(table.name, table, rows)
        return
    _insert_arrays(table.name, table, rows)


def _insert_arrays(target: str, table: Table, rows: Sequence[tuple], tail: str = "", answer: bool = False):
    """The rows as one array per column, unnested into `target`; the returned rows when `answer`."""
    connection.ensure_connection()
    arrays = ", ".join(f"%b::{kind}[]" for _, kind in table.columns)
    columns = [_typed(kind, column) for (_, kind), column in zip(table.columns, zip(*rows, strict=True), strict=True)]
    # A cursor of Django's connection, so in its transaction and its pipeline, binding on the server.
    with psycopg.Cursor(connection.connection) as cursor:
        cursor.execute(
            f"INSERT INTO {target} ({table.column_list}) SELECT * FROM unnest({arrays}) WHERE true{tail}", columns
        )
        return [tuple(row) for row in cursor.fetchall()] if answer else []


def _typed(kind: str, values: tuple) -> list:
    """A column's values as one array: psycopg dumps a list of one Python type only, and a float column
    may be handed a whole number."""
    if kind == "float8":
        return [value if value is None else float(value) for value in values]
    return list(values)


def _insert_values(target: str, table: Table, rows: Sequence[tuple]) -> None:
    placeholders = "(" + ", ".join(["%s"] * len(table.columns)) + ")"
    with connection.cursor() as cursor:
        for start in range(0, len(rows), SQLITE_ROWS_PER_STATEMENT):
            chunk = rows[start : start + SQLITE_ROWS_PER_STATEMENT]
            cursor.execute(
                f"INSERT INTO {target} ({table.column_list}) VALUES {', '.join([placeholders] * len(chunk))}",
                [value for row in chunk for value in row],
            )
