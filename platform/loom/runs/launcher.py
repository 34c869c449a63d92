"""Launch an attempt: claim it, prepare its work dir, submit it to the launch backend, record the handle.

The launch task returns once the backend has the attempt; from then on the backend runs it and the reconciler
(reconciler.py) follows it to its end, so no run depends on the worker that launched it staying alive. The
claim records STARTING in the transaction that takes the attempt, so the event exists exactly when the claim
does, whatever becomes of the worker or the ingest API afterwards.
"""

import json
import logging
import math
from pathlib import Path

from django.conf import settings
from django.db import connection, transaction

from loom.accounts.tokens import hash_token, mint_token
from loom.checkpoints.services import checkpoint_dir_for
from loom.datasets.references import SourceGone, with_directories
from loom.telemetry.services import record_platform_event
from trainer.config import world_size_of

from . import states
from .backends import Backend, LaunchSpec, current_backend
from .db_retry import retrying
from .failures import LAUNCH_ERROR, Failure
from .lifecycle import Ending, end_attempt
from .models import Attempt
from .nodes import excluded_names
from .services import mirror_on_run

log = logging.getLogger(__name__)

# The advisory lock's first key: loom's claims, whatever else takes advisory locks on the database.
CLAIM_LOCK = 0x6C6F6F6D


class LaunchRefused(Exception):
    """The attempt cannot be launched as configured on this backend (the message says why and what would do)."""


class BackendFull(Exception):
    """The backend runs as many attempts as it may; this one stays queued and is offered again shortly."""


def claim_attempt(attempt_id: int, backend: Backend | None = None) -> tuple[Attempt, str] | None:
    """Atomically move a queued attempt to starting and mint its token; None if already taken. A backend with
    `max_active` (the local one) takes it only below that many active attempts, else BackendFull."""
    token = mint_token("attempt")
    limit = getattr(backend, "max_active", None)
    with transaction.atomic():
        if limit is not None:
            _serialize_claims(backend.name)
            active = Attempt.objects.filter(backend=backend.name, state__in=states.ACTIVE - {states.QUEUED})
            if active.count() >= limit and Attempt.objects.filter(pk=attempt_id, state=states.QUEUED).exists():
                raise BackendFull(f"the {backend.name} backend runs {limit} attempts at once")
        claimed = Attempt.objects.filter(pk=attempt_id, state=states.QUEUED, token_hash="").update(
            state=states.STARTING, token_hash=hash_token(token), backend=backend.name if backend else ""
        )
        if not claimed:
            return None
        attempt = Attempt.objects.select_related("run").get(pk=attempt_id)
        # Known from the moment its token exists: the ingest API takes only commits inside it.
        attempt.work_dir = str(work_dir_for(attempt))
        attempt.save(update_fields=["work_dir"])
        mirror_on_run(attempt)
        record_platform_event(attempt.run, attempt, "state", {"attempt": attempt.number, "state": states.STARTING})
    return attempt, token


def _serialize_claims(backend_name: str) -> None:
    """Two workers counting a backend's active attempts at once would both see room for one more: on PostgreSQL
    the count and the claim hold a transaction-scoped advisory lock (SQLite runs one writer at a time anyway)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [CLAIM_LOCK, backend_name])


def work_dir_for(attempt: Attempt) -> Path:
    """Derived from the run's and the attempt's ids alone: no config names where an attempt writes."""
    return Path(settings.LOOM_RUNS_DIR) / f"run-{attempt.run_id}" / f"attempt-{attempt.number}"


def trainer_config(attempt: Attempt, work_dir: Path) -> dict:
    """The attempt's config as its ranks read it: checkpoints go to the attempt's own directory, whatever the
    stored config says (one stored before the platform refused directories may name one), and the dataset and
    starting weights it names by reference are their directories (SourceGone when one was deleted since)."""
    config = with_directories(attempt.config)
    checkpoint = {**config.get("checkpoint", {}), "directory": str(checkpoint_dir_for(work_dir))}
    return {**config, "checkpoint": checkpoint}


def launch(attempt_id: int) -> str:
    """Claim and submit the attempt: "submitted", "skipped" (claimed already), "full" (the backend has no room
    yet: the caller offers it again later) or the state it ended in when it could not be submitted."""
    backend = current_backend()
    try:
        claimed = claim_attempt(attempt_id, backend)
    except BackendFull:
        return "full"
    if claimed is None:
        log.info("attempt %s is not queued any more; this delivery does nothing", attempt_id)
        return "skipped"
    attempt, token = claimed
    work_dir = work_dir_for(attempt)
    (work_dir / "logs").mkdir(parents=True, exist_ok=True)
    config_path = work_dir / "config.json"
    try:
        config_path.write_text(json.dumps(trainer_config(attempt, work_dir), indent=2))
        spec = launch_spec(attempt, token, work_dir, config_path, backend)
        handle = backend.submit(spec)
    except (OSError, LaunchRefused, SourceGone) as error:
        failure = Failure(LAUNCH_ERROR, f"could not submit the attempt to the {backend.name} backend: {error}")
        end_attempt(attempt.pk, Ending(states.FAILED, reason=failure.reason, failure=failure))
        return states.FAILED
    retrying(lambda: Attempt.objects.filter(pk=attempt.pk).update(backend_handle=handle))
    # A cancel that came while the attempt was being submitted found no handle to stop: stop it now.
    if retrying(lambda: Attempt.objects.filter(pk=attempt.pk, cancel_requested=True).exists()):
        backend.cancel(handle, settings.LOOM_CANCEL_GRACE_S)
    log.info("attempt %s of run %s submitted to the %s backend", attempt.number, attempt.run_id, backend.name)
    return "submitted"


def launch_spec(attempt: Attempt, token: str, work_dir: Path, config_path: Path, backend: Backend) -> LaunchSpec:
    world_size = world_size_of(attempt.config)
    nodes, ranks_per_node = node_shape(world_size, backend)
    excluded = tuple(sorted({*excluded_names(backend), *attempt.avoid_nodes}))
    env = {
        # The trainer's LOOM_URL is where it sends telemetry.
        "LOOM_URL": settings.LOOM_INGEST_URL,
        "LOOM_TOKEN": token,
        "LOOM_ATTEMPT": str(attempt.pk),
        "LOOM_ATTEMPT_NUMBER": str(attempt.number),
        "LOOM_SPOOL_DIR": str(work_dir / "spool"),
        "LOOM_RUN_ID": str(attempt.run_id),
        "LOOM_CHECKPOINT_DIR": str(checkpoint_dir_for(work_dir)),
    }
    return LaunchSpec(
        attempt_id=attempt.pk,
        run_id=attempt.run_id,
        number=attempt.number,
        work_dir=work_dir,
        config_path=config_path,
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        env=env,
        exclude=excluded,
    )


def node_shape(world_size: int, backend: Backend) -> tuple[int, int]:
    """How many nodes and ranks per node: one host for the local backend; else as few nodes of
    LOOM_RANKS_PER_NODE ranks as hold the world, every node running as many ranks."""
    if not getattr(backend, "spans_nodes", False):
        return 1, world_size
    per_node = min(world_size, settings.LOOM_RANKS_PER_NODE)
    nodes = math.ceil(world_size / per_node)
    if nodes * per_node != world_size:
        raise LaunchRefused(
            f"{world_size} ranks do not fill whole nodes of {per_node} (LOOM_RANKS_PER_NODE); "
            f"use a world size that is a multiple of {per_node}"
        )
    return nodes, per_node
