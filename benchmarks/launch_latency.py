"""Time from Launch to every rank's first step, the local backend against Slurm across two nodes: the same
layout (dp 2 × tp 2, four ranks), the same platform, one after the other. Goal (issue 21): Slurm ≤ 1.3× local.

The platform runs as a deployment does (tests/deployment.py: uvicorn, a launch worker, a monitor worker with
Celery beat and the reconciler, on a private PostgreSQL and Redis the benchmark starts), once with
LOOM_BACKEND=local and once with LOOM_BACKEND=slurm onto a real three-node Slurm cluster on this machine
(tests/slurm_cluster.py: a network and UTS namespace per node). For each backend, `--runs` runs are created
through the API one after another; for each, the seconds from the POST to the arrival of the last rank's step-1
metric (the database's received_at), and to the run's end. Reported: medians and the Slurm / local ratio.

    .venv/bin/python benchmarks/launch_latency.py [--runs 5]      (as root: it makes network namespaces)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.deployment import Deployment, PrivatePostgres, PrivateRedis, wait_until  # noqa: E402
from tests.slurm_cluster import start_cluster  # noqa: E402

RANKS = 4
CONFIG = {
    "steps": 5,
    "model": {"layers": 2, "dim": 64, "heads": 4, "kv_heads": 2, "ffn": 172, "seq_len": 64},
    "parallel": {"dp_replicate": 2, "tp": 2},
    "optimizer": {"lr": 0.003, "warmup_steps": 2},
    "data": {"micro_batch": 4, "corpus_bytes": 300000},
    "telemetry": {"flush_interval_s": 0.2, "heartbeat_interval_s": 1.0},
}


def first_steps_s(deployment: Deployment, run_id: int, posted_at: float) -> tuple[float, float]:
    """Seconds from the POST to every rank's first step stored, and to the run's end."""

    def every_rank_stepped():
        rows = deployment.rows(
            "SELECT rank, min(extract(epoch FROM received_at)) AS at FROM telemetry_event "
            "WHERE run_id = %s AND kind = 'metric' AND step = 1 GROUP BY rank",
            run_id,
        )
        return rows if len(rows) == RANKS else None

    arrivals = wait_until(every_rank_stepped, 300, f"every rank of run {run_id} to report step 1")
    first_step = max(float(row["at"]) for row in arrivals) - posted_at
    wait_until(lambda: deployment.run(run_id)["state"] in ("succeeded", "failed", "cancelled"), 300, "the run's end")
    state = deployment.run(run_id)["state"]
    if state != "succeeded":
        raise RuntimeError(f"run {run_id} ended {state}: {deployment.run(run_id)['attempts']}")
    (ended,) = deployment.rows(
        "SELECT extract(epoch FROM finished_at) AS at FROM runs_attempt WHERE run_id = %s AND number = 1", run_id
    )
    return first_step, float(ended["at"]) - posted_at


def measure(backend: str, cluster, postgres, redis_server, runs: int) -> list[tuple[float, float]]:
    settings = {
        "LOOM_BACKEND": backend,
        "LOOM_SLURM_CONF": str(cluster.conf),
        "LOOM_RANKS_PER_NODE": "2",
        "LOOM_ALLOWED_HOSTS": f"127.0.0.1,localhost,{cluster.host_address}",
    }
    deployment = Deployment(postgres, redis_server, host=cluster.host_address, **settings).start()
    try:
        timings = []
        for index in range(runs):
            posted_at = time.time()
            answer = deployment.post_run(CONFIG, f"{backend} {index}")
            if answer.status != 201:
                raise RuntimeError(f"POST /api/runs answered {answer.status}: {answer.body}")
            timings.append(first_steps_s(deployment, answer.body["id"], posted_at))
            first, end = timings[-1]
            print(f"  {backend} run {index + 1}: every rank's first step {first:.2f} s, end {end:.2f} s")
        return timings
    finally:
        deployment.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="runs per backend")
    args = parser.parse_args()
    cluster = start_cluster()
    postgres, redis_server = PrivatePostgres(), PrivateRedis()
    try:
        results = {
            backend: measure(backend, cluster, postgres, redis_server, args.runs) for backend in ("local", "slurm")
        }
    finally:
        redis_server.close()
        postgres.close()
        cluster.stop()
    medians = {
        backend: [statistics.median(column) for column in zip(*timings, strict=True)]
        for backend, timings in results.items()
    }
    for backend, (first, end) in medians.items():
        where = "one host" if backend == "local" else "2 Slurm nodes × 2 ranks"
        print(f"{backend:5} ({where}): every rank's first step {first:.2f} s, run ended {end:.2f} s", end="")
        print(f" (median of {args.runs})")
    ratio = medians["slurm"][0] / medians["local"][0]
    verdict = "met" if ratio <= 1.3 else "NOT met"
    print(f"Launch → every rank's first step, Slurm / local: {ratio:.2f} (goal ≤ 1.3: {verdict})")


if __name__ == "__main__":
    main()
