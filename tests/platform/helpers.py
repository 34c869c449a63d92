"""Building blocks for platform tests: real runs and attempts in the test database."""

import time
from pathlib import Path

from loom.checkpoints.services import checkpoint_dir_for
from loom.runs.backends import NodeInfo
from loom.runs.launcher import claim_attempt
from loom.runs.models import Run
from loom.runs.services import create_run
from loom.telemetry.services import ingest_batch

TINY_CONFIG = {
    "steps": 20,
    "model": {"layers": 2, "dim": 64, "heads": 4, "kv_heads": 2, "ffn": 172, "seq_len": 64},
    "parallel": {"dp_replicate": 2},
    "optimizer": {"lr": 0.003, "warmup_steps": 2},
    "data": {"micro_batch": 4, "corpus_bytes": 300000},
    "telemetry": {"flush_interval_s": 0.2, "heartbeat_interval_s": 1.0},
}


# When each batch was first built. Building the same batch again, as a rank's retry resends it, gives the same
# events (other events under one seq are a conflict); every batch is as recent as a live rank's, so the
# platform's alert watcher judges its steps as fresh measurements, however long the test session has run.
_first_built: dict[tuple, float] = {}


def claimed_run(owner, name="claimed", config=None):
    """A run whose first attempt is claimed as a launcher would, returning (run, attempt, token)."""
    run = create_run(owner, name, config or TINY_CONFIG)
    attempt, token = claim_attempt(run.attempts.get().pk)
    return run, attempt, token


def batch(attempt, rank=0, seq=0, steps=(1, 2, 3)):
    """The same arguments give the same batch, as a rank's retry resends it (other events under the same seq
    are a conflict)."""
    emitted_s = _first_built.setdefault((attempt.pk, rank, seq, tuple(steps)), time.time())
    return {
        "attempt": attempt.pk,
        "rank": rank,
        "seq": seq,
        "events": [
            {"kind": "metric", "time": emitted_s, "step": step, "payload": {"loss": 5.0 - step / 10}} for step in steps
        ],
    }


def event_count(run: Run, **filters) -> int:
    return run.events.filter(**filters).count()


class BatchSender:
    """Numbered batches for one attempt, per rank, stored through the ingest service as its ranks
    and its launcher (rank -1) would send them."""

    def __init__(self, attempt):
        self.attempt = attempt
        self.seq = {}

    def send(self, rank, *events):
        seq = self.seq.get(rank, 0)
        self.seq[rank] = seq + 1
        return ingest_batch(self.attempt, rank, seq, list(events))


def own_checkpoint(attempt, step) -> str:
    """Where the attempt's ranks write the checkpoint of `step`: the ingest API records commits only there."""
    return str(checkpoint_dir_for(Path(attempt.work_dir)) / f"step-{step:06d}")


def checkpoint_event(state, step, path, time=100.0, **payload):
    payload = {"state": state, "step": step, "path": path, **payload}
    return {"kind": "checkpoint", "time": time, "step": step, "payload": payload}


class NodeListingBackend:
    """A launch backend that lists fixed nodes and launches nothing, for tests that only read nodes or create
    runs (the Slurm and local tests exercise real backends). A subclass names itself and its nodes."""

    name = ""
    listed: tuple[NodeInfo, ...] = ()

    def submit(self, spec):
        raise NotImplementedError(f"the {self.name} backend lists nodes only; it cannot launch {spec.attempt_id}")

    def observe(self, handles):
        return {}

    def cancel(self, handle, grace_s):
        raise NotImplementedError(f"the {self.name} backend launched nothing to cancel")

    def nodes(self):
        return list(self.listed)
