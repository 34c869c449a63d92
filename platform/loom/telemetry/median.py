"""A Median aggregate, so a band's middle line is computed where its rows are instead of in the web process:
PostgreSQL's percentile_cont, and on SQLite (the embedded default) an aggregate registered on each connection.
Both give the mean of the middle two values of an even group and ignore NULLs."""

import statistics

from django.db.models import Aggregate, FloatField

SQLITE_FUNCTION = "LOOM_MEDIAN"


class Median(Aggregate):
    function = "PERCENTILE_CONT"
    name = "Median"
    output_field = FloatField()
    template = "%(function)s(0.5) WITHIN GROUP (ORDER BY %(expressions)s)"

    def as_sqlite(self, compiler, connection, **extra_context):
        return self.as_sql(
            compiler, connection, function=SQLITE_FUNCTION, template="%(function)s(%(expressions)s)", **extra_context
        )


class _SQLiteMedian:
    def __init__(self):
        self.values = []

    def step(self, value):
        if value is not None:
            self.values.append(value)

    def finalize(self):
        return statistics.median(self.values) if self.values else None


def register_on_sqlite(sender, connection, **kwargs) -> None:
    """connection_created receiver."""
    if connection.vendor == "sqlite":
        connection.connection.create_aggregate(SQLITE_FUNCTION, 1, _SQLiteMedian)
