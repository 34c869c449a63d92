"""Log records for machines: one JSON object a line (LOOM_LOG_FORMAT=json), each naming the run and attempt
it was logged for. The ingest request and the Celery tasks acting on an attempt say which with
run_context(); RunContextFilter, on the console handler, puts them on every record logged meanwhile."""

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime

_current_run: ContextVar[tuple[int | None, int | None]] = ContextVar("loom_current_run", default=(None, None))


@contextmanager
def run_context(run_id: int | None, attempt_id: int | None) -> Iterator[None]:
    token = _current_run.set((run_id, attempt_id))
    try:
        yield
    finally:
        _current_run.reset(token)


class RunContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "run_id"):
            record.run_id, record.attempt_id = _current_run.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        document = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
            "thread": record.threadName,
        }
        for name in ("run_id", "attempt_id"):
            if getattr(record, name, None) is not None:
                document[name] = getattr(record, name)
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            document["stack"] = self.formatStack(record.stack_info)
        return json.dumps(document, default=str)


def write_json(logger: logging.Logger) -> None:
    """Turn the handlers someone else gave `logger` (Celery's, for its worker) to JSON with the run context."""
    for handler in logger.handlers:
        handler.setFormatter(JsonFormatter())
        handler.addFilter(RunContextFilter())
