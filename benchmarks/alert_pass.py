"""What one alert pass over a 1,024-rank attempt costs as the run grows: the watcher judges every reporting
attempt once a second in the ingest process, so that cost must not grow with the run's length.

A database of its own on the PostgreSQL server of DATABASE_URL (`loom_bench_<pid>`, dropped afterwards) holds
two runs of N ranks, their attempts filled by SQL as ingest would have filled RankStep: a short one
(`--short` steps) and a long one (`--long` steps). One pass of the detectors (loom.alerts.evaluate, as the
watcher calls it after each second's metrics) is timed `--passes` times over each; reported: the median and
p95 per pass for each length, and the long / short ratio (1.0: the pass reads only the latest steps).

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test .venv/bin/python benchmarks/alert_pass.py
    DATABASE_URL=… .venv/bin/python benchmarks/alert_pass.py --ranks 256 --long 2000     # quick
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ingest_load import Platform, run_config  # noqa: E402 — the benchmarks folder is on the path only now

MEASURE = """
import json, os, statistics, time
from unittest import mock
from django.db import connection
from loom.accounts.services import ensure_user
from loom.alerts.evaluate import evaluate
from loom.runs.launcher import claim_attempt
from loom.runs.services import create_run

ranks, passes = int(os.environ["BENCH_RANKS"]), int(os.environ["BENCH_PASSES"])
user = ensure_user("bench", "bench-password")


def seeded_attempt(steps):
    with mock.patch("loom.runs.services.send_launch"):
        run = create_run(user, f"{ranks} ranks x {steps} steps", json.loads(os.environ["BENCH_CONFIG"]))
    attempt, _ = claim_attempt(run.attempts.get().pk)
    with connection.cursor() as cursor:
        cursor.execute(
            '''INSERT INTO telemetry_rankstep (run_id, attempt_id, rank, step, time, loss, loss_mean, grad_norm,
                   lr, step_time_s, compute_s, tokens_per_s, mfu, memory_bytes, memory_peak_bytes)
               SELECT %s, %s, r, s, now() - (%s - s) * interval '1 second', 2 + 6 * exp(-s / 500.0),
                   2 + 6 * exp(-s / 500.0), 1 + random() * 0.2, 3e-4, 1.0 + random() * 0.02,
                   0.6 + random() * 0.02, 512, 0.4, 41000000000 + r * 1000, 62000000000
               FROM generate_series(0, %s - 1) AS r, generate_series(1, %s) AS s''',
            [run.pk, attempt.pk, steps, ranks, steps],
        )
        cursor.execute("ANALYZE telemetry_rankstep")
    return attempt


def timed(attempt, steps):
    evaluate(attempt, [], steps)  # warm: the connection, the query plans
    seconds = []
    for _ in range(passes):
        started = time.perf_counter()
        evaluate(attempt, [], steps)
        seconds.append(time.perf_counter() - started)
    seconds.sort()
    return {"median_ms": statistics.median(seconds) * 1000, "p95_ms": seconds[int(0.95 * (len(seconds) - 1))] * 1000}


results = {}
for name in ("short", "long"):
    steps = int(os.environ[f"BENCH_{name.upper()}"])
    results[name] = timed(seeded_attempt(steps), steps)
print(json.dumps(results))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--short", type=int, default=100, help="steps of the short attempt")
    parser.add_argument("--long", type=int, default=5000, help="steps of the long attempt")
    parser.add_argument("--passes", type=int, default=30, help="passes timed over each attempt")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="loom-alert-bench-") as home:
        platform = Platform(Path(home), "postgres", debug=False, limit_concurrency=None)
        platform.create_database()
        try:
            platform.migrate()
            output = platform.django(
                MEASURE,
                BENCH_RANKS=str(args.ranks),
                BENCH_SHORT=str(args.short),
                BENCH_LONG=str(args.long),
                BENCH_PASSES=str(args.passes),
                BENCH_CONFIG=json.dumps(run_config(args.ranks)),
            )
        finally:
            platform.drop_database()
    results = json.loads(output.strip().splitlines()[-1])
    for name in ("short", "long"):
        steps = getattr(args, name)
        figures = results[name]
        print(
            f"{args.ranks:,} ranks × {steps:,} steps ({args.ranks * steps:,} RankStep rows): one pass "
            f"{figures['median_ms']:.1f} ms median, {figures['p95_ms']:.1f} ms p95 over {args.passes} passes"
        )
    ratio = results["long"]["median_ms"] / results["short"]["median_ms"]
    print(f"long / short: {ratio:.2f} (a run {args.long / args.short:.0f}× longer)")


if __name__ == "__main__":
    main()
