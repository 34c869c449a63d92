"""Database errors while following an attempt are retried, never fatal: a PostgreSQL restart must not lose
the handle of a job that is already running."""

import logging
import time

from django.db import InterfaceError, OperationalError, close_old_connections, connection

log = logging.getLogger(__name__)

FIRST_WAIT_S = 0.5
LONGEST_WAIT_S = 10.0
GIVE_UP_AFTER_S = 600.0


def retrying(operation, give_up_after_s: float = GIVE_UP_AFTER_S):
    """operation()'s result, trying again with a fresh connection while the database is unreachable."""
    deadline = time.monotonic() + give_up_after_s
    wait = FIRST_WAIT_S
    while True:
        try:
            return operation()
        except (OperationalError, InterfaceError) as error:
            if time.monotonic() + wait > deadline:
                raise
            log.warning("database unavailable (%s); trying again in %.1f s", error, wait)
            connection.close()
            time.sleep(wait)
            close_old_connections()
            wait = min(wait * 2, LONGEST_WAIT_S)
