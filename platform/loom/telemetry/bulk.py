"""Bulk writes for ingest: each table's rows of a group commit in one statement.

On PostgreSQL every column travels as one array parameter and is unnested by the server: the statement
text stays the same whatever the number of rows, so psycopg converts it once and binds the arrays in C,
where a VALUES list of thousands of placeholders was parsed and quoted value by value in Python (most of
the writer's CPU at 1,024 ranks). Rows that cannot conflict (new events) go by COPY. SQLite, the embedded
default, gets multi-row VALUES statements within its limit on bound variables.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from django.db import connection

# Rows per VALUES statement on SQLite: times the widest table's columns, well under its 32,766 variables.
SQLITE_ROWS_PER_STATEMENT = 400


@dataclass(frozen=True)
class Table:
    name: str
    # (column, PostgreSQL type of its array parameter's elements)
    columns: tuple[tuple[str, str], ...]

    @property
    def column_list(self) -> str:
        return ", ".join(name for name, _ in self.columns)


def insert(table: Table, rows: Sequence[tuple], conflict: str = "", returning: str = "") -> list[tuple]:
    """INSERT the rows with `conflict` (an ON CONFLICT clause, where `excluded.` names the new row) and
    `returning` (columns to answer with); the returned rows, in no particular order."""
    if not rows:
        return []
    tail = f" {conflict}" if conflict else ""
    tail += f" RETURNING {returning}" if returning else ""
    if connection.vendor == "postgresql":
        return _insert_unnested(table, rows, tail, bool(returning))
    returned = []
    with connection.cursor() as cursor:
        placeholders = "(" + ", ".join(["%s"] * len(table.columns)) + ")"
        for start in range(0, len(rows), SQLITE_ROWS_PER_STATEMENT):
            chunk = rows[start : start + SQLITE_ROWS_PER_STATEMENT]
            values = ", ".join([placeholders] * len(chunk))
            cursor.execute(
                f"INSERT INTO {table.name} ({table.column_list}) VALUES {values}{tail}",
                [value for row in chunk for value in row],
            )
            if returning:
                returned.extend(tuple(row) for row in cursor.fetchall())
    return returned


def _insert_unnested(table: Table, rows: Sequence[tuple], tail: str, returning: bool) -> list[tuple]:
    arrays = ", ".join(f"%s::{kind}[]" for _, kind in table.columns)
    columns = [list(column) for column in zip(*rows, strict=True)]
    with _server_bound_cursor() as cursor:
        cursor.execute(f"INSERT INTO {table.name} ({table.column_list}) SELECT * FROM unnest({arrays}){tail}", columns)
        return [tuple(row) for row in cursor.fetchall()] if returning else []


def copy(table: Table, rows: Sequence[tuple]) -> None:
    """Append rows no constraint can refuse; COPY on PostgreSQL."""
    if connection.vendor != "postgresql":
        insert(table, rows)
        return
    with _server_bound_cursor() as cursor, cursor.copy(f"COPY {table.name} ({table.column_list}) FROM STDIN") as out:
        for row in rows:
            out.write_row(row)


def _server_bound_cursor() -> psycopg.Cursor:
    """A cursor of Django's connection (so in its transaction) that binds parameters server-side; Django's
    own cursors bind client-side."""
    connection.ensure_connection()
    return psycopg.Cursor(connection.connection)
