"""What one reconciler pass costs with many active attempts: Celery beat runs it every few seconds on the
monitor worker, so its CPU must stay far below its interval. Goal (issue 21): ≤ 1 s of CPU for 1,000 active
attempts.

A database of its own (`loom_bench_<pid>` on DATABASE_URL's PostgreSQL, dropped afterwards; SQLite without
DATABASE_URL) holds N running attempts of the local backend, each with the handle of a real process (a `sleep`
the benchmark starts, so every observation reads /proc as it would for torchrun's supervisor). Passes are timed
over N attempts and over `--small` of them; reported: CPU and wall time per pass, median over `--passes`, and
the cost per attempt at each size (equal: a pass grows linearly, one look per attempt and no write when
nothing changed).

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test .venv/bin/python benchmarks/reconcile_pass.py
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ingest_load import Platform  # noqa: E402 — the benchmarks folder is on the path only now

MEASURE = """
import json, os, statistics, subprocess, time
from django.db import connection
from loom.accounts.services import ensure_user
from loom.runs import states
from loom.runs.backends.local import pid_namespace
from loom.runs.backends.process_tree import started_at
from loom.runs.models import Attempt, Run
from loom.runs.reconciler import reconcile

count, small = int(os.environ["BENCH_ATTEMPTS"]), int(os.environ["BENCH_SMALL"])
passes = int(os.environ["BENCH_PASSES"])
user = ensure_user("bench", "bench-password")
here = pid_namespace()
sleepers = [subprocess.Popen(["sleep", "3600"]) for _ in range(count)]
try:
    attempts = []
    for index, sleeper in enumerate(sleepers):
        run = Run.objects.create(owner=user, name=f"running {index}", config={}, state=states.RUNNING)
        handle = {"pid": sleeper.pid, "started_at": started_at(sleeper.pid), "pid_namespace": here, "host": "bench",
                  "work_dir": "/nonexistent"}
        attempts.append(Attempt(run=run, number=1, config={}, state=states.RUNNING, token_hash=f"{index:064d}",
                                backend="local", backend_handle=handle, nodes=["bench"]))
    Attempt.objects.bulk_create(attempts)

    def timed(active):
        chosen = list(Attempt.objects.order_by("pk").values_list("pk", flat=True)[:active])
        Attempt.objects.exclude(pk__in=chosen).update(state=states.SUCCEEDED)
        Attempt.objects.filter(pk__in=chosen).update(state=states.RUNNING)
        reconcile(lambda attempt_id: None)  # warm: the connection, the query plans
        cpu, wall = [], []
        for _ in range(passes):
            started_cpu, started_wall = time.process_time(), time.perf_counter()
            result = reconcile(lambda attempt_id: None)
            cpu.append(time.process_time() - started_cpu)
            wall.append(time.perf_counter() - started_wall)
            assert not result.ended and not result.running, "a pass changed a running attempt"
        return {"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall)}

    print(json.dumps({"small": timed(small), "large": timed(count)}))
finally:
    for sleeper in sleepers:
        sleeper.kill()
        sleeper.wait()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attempts", type=int, default=1000)
    parser.add_argument("--small", type=int, default=100, help="active attempts of the smaller pass")
    parser.add_argument("--passes", type=int, default=10)
    args = parser.parse_args()
    import os

    database = "postgres" if os.environ.get("DATABASE_URL") else "sqlite"
    with tempfile.TemporaryDirectory(prefix="loom-reconcile-bench-") as home:
        platform = Platform(Path(home), database, debug=False, limit_concurrency=None)
        platform.create_database()
        try:
            platform.migrate()
            output = platform.django(
                MEASURE, BENCH_ATTEMPTS=str(args.attempts), BENCH_SMALL=str(args.small), BENCH_PASSES=str(args.passes)
            )
        finally:
            platform.drop_database()
    results = json.loads(output.strip().splitlines()[-1])
    for name, active in (("small", args.small), ("large", args.attempts)):
        figures = results[name]
        print(
            f"{active:,} active attempts ({database}): one pass {figures['cpu_s'] * 1000:.0f} ms CPU, "
            f"{figures['wall_s'] * 1000:.0f} ms wall (median of {args.passes}); "
            f"{figures['cpu_s'] / active * 1e6:.0f} µs CPU per attempt"
        )
    per_small = results["small"]["cpu_s"] / args.small
    per_large = results["large"]["cpu_s"] / args.attempts
    print(f"CPU per attempt, {args.attempts:,} / {args.small:,} active: {per_large / per_small:.2f}")
    print(
        f"goal: one pass over 1,000 attempts ≤ 1 s of CPU: {'met' if results['large']['cpu_s'] <= 1.0 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
