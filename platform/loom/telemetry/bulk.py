"""Bulk writes for ingest: each table's rows of a group commit in a fixed number of statements.

Rows are first put in a temporary stage table of the connection (COPY on PostgreSQL, whose rows psycopg
formats in C; multi-row VALUES on SQLite, the embedded default) and then moved by one INSERT … SELECT,
which may resolve conflicts, return keys, or aggregate (the heatmap tiles): the statement text never
depends on the number of rows, and no value passes through Python's own formatting. Rows that cannot
conflict (new events) are copied straight into their table.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

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
    them; emptied again afterwards. Inside the caller's transaction (or one of its own)."""
    stage = f"stage_{table.name}"
    postgresql = connection.vendor == "postgresql"
    # SQLite's columns get no declared type: its type affinity would turn JSON text like "3" into a number.
    columns = ", ".join(f"{name} {kind}" if postgresql else name for name, kind in table.columns)
    # A stage created by a transaction that rolls back is gone with it, so it is asked for every time.
    create = f"CREATE TEMP TABLE IF NOT EXISTS {stage} ({columns})" + (" ON COMMIT DELETE ROWS" if postgresql else "")
    with transaction.atomic(savepoint=False), connection.cursor() as cursor:
        cursor.execute(create)
        if postgresql:
            _copy_rows(stage, table, rows)
        else:
            _insert_values(stage, table, rows)
        yield stage
        cursor.execute(f"DELETE FROM {stage}")


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
