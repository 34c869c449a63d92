"""How long the run page of a large run takes to load: 1,024 ranks × 10,000 steps (goal: ≤ 2 s).

A database of its own on the PostgreSQL server of DATABASE_URL (`loom_bench_<pid>`, dropped afterwards) is
filled as ingest would have filled it, but by SQL (generate_series) so that seeding takes minutes, not hours:
one run of N ranks (tp 8 × pp 4 × FSDP over the rest), a RankStep row per rank and step (rank 77 is 30 %
slower, a straggler), every RankTile level summed from those rows, each rank's host, and a `comm` event per
rank for every 10-step window (the trainer's default; each rank's row of the planner's predicted matrix),
the last window stored through the ingest store. The metric events themselves are not seeded: the page never
reads them (it reads RankStep/RankTile, and the events before its snapshot by kind, through an index).

Then the web process is started as `bin/up` starts it, and in headless Chromium (Playwright, Debian's
chromium, benchmarks/browser.py) a logged-in user opens the run page `--loads` times; reported (medians): the
time from navigation to the page's snapshot drawn (page_load below), then to the traffic matrix drawn, and
each API answer's time as the page's own requests saw them.

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test .venv/bin/python benchmarks/run_page_load.py
    DATABASE_URL=… .venv/bin/python benchmarks/run_page_load.py --ranks 128 --steps 2000    # quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from browser import logged_in_page  # noqa: E402 — the benchmarks folder is on the path only now
from ingest_load import Platform, run_config  # noqa: E402

PASSWORD = "bench-password"
SLOW_RANK = 77

SEED = """
import json, os, time
from django.db import connection
from loom.accounts.services import ensure_user
from loom.runs.launcher import claim_attempt
from loom.runs.services import create_run
from loom.telemetry.services import pending_batch, AttemptRef
from loom.telemetry.store import TILE_SPANS, store_batches
from unittest import mock

ranks, steps, slow = int(os.environ["BENCH_RANKS"]), int(os.environ["BENCH_STEPS"]), int(os.environ["BENCH_SLOW"])
COMM_WINDOW = 10  # the trainer's default comm_window_steps
user = ensure_user("bench", os.environ["BENCH_PASSWORD"])
with mock.patch("loom.runs.services.send_launch"):
    run = create_run(user, f"{ranks} ranks x {steps} steps", json.loads(os.environ["BENCH_CONFIG"]))
attempt, _ = claim_attempt(run.attempts.get().pk)
started = time.monotonic()
with connection.cursor() as cursor:
    cursor.execute(
        '''INSERT INTO telemetry_rankstep (run_id, attempt_id, rank, step, time, loss, loss_mean, grad_norm, lr,
               step_time_s, tokens_per_s, mfu, memory_bytes, memory_peak_bytes)
           SELECT %s, %s, r, s, now() - (%s - s) * interval '1 second', 2 + 6 * exp(-s / 500.0),
               2 + 6 * exp(-s / 500.0), 1 + random() * 0.2, 3e-4,
               (CASE WHEN r = %s THEN 1.3 ELSE 1.0 END) + random() * 0.02, 512 / 1.0, 0.4,
               41000000000 + r * 1000 + s, 62000000000
           FROM generate_series(0, %s - 1) AS r, generate_series(1, %s) AS s''',
        [run.pk, attempt.pk, steps, slow, ranks, steps],
    )
    seeded_steps = time.monotonic() - started
    for span in TILE_SPANS:
        cursor.execute(
            '''INSERT INTO telemetry_ranktile (attempt_id, span, bucket, rank, count, step_time_sum, step_time_min,
                   step_time_max, memory_sum, memory_min, memory_max)
               SELECT attempt_id, %s, step / %s, rank, count(*), sum(step_time_s), min(step_time_s),
                   max(step_time_s), sum(memory_bytes), min(memory_bytes), max(memory_bytes)
               FROM telemetry_rankstep WHERE attempt_id = %s GROUP BY attempt_id, step / %s, rank''',
            [span, span, attempt.pk, span],
        )
    cursor.execute(
        '''INSERT INTO telemetry_rankstatus (attempt_id, rank, host, pid, last_heartbeat, last_step)
           SELECT %s, r, 'node' || lpad((r / 8)::text, 4, '0'), 10000 + r, now(), %s
           FROM generate_series(0, %s - 1) AS r''',
        [attempt.pk, steps, ranks],
    )
    rows = json.loads(open(os.environ["BENCH_COMM_FILE"]).read())
    # Every earlier window's comm events, one per rank, as the trainer sends one every COMM_WINDOW steps.
    cursor.execute(
        '''WITH rows AS (SELECT (element->>'rank')::int AS rank, element AS payload
                         FROM jsonb_array_elements(%s::jsonb) AS element)
           INSERT INTO telemetry_event (run_id, seq, attempt_id, kind, rank, step, payload, time, received_at)
           SELECT %s, (SELECT last_seq FROM runs_run WHERE id = %s) + row_number() OVER (ORDER BY w, rank),
               %s, 'comm', rank, w * %s,
               payload || jsonb_build_object('window', jsonb_build_array(w * %s - %s + 1, w * %s)),
               now() - (%s - w * %s) * interval '1 second', now()
           FROM generate_series(1, %s / %s - 1) AS w CROSS JOIN rows''',
        [json.dumps(rows), run.pk, run.pk, attempt.pk, *[COMM_WINDOW] * 4, steps, COMM_WINDOW, steps, COMM_WINDOW],
    )
    cursor.execute(
        "UPDATE runs_run SET last_seq = (SELECT max(seq) FROM telemetry_event WHERE run_id = %s) WHERE id = %s",
        [run.pk, run.pk],
    )
    cursor.execute("ANALYZE")
ref = AttemptRef(attempt.pk, attempt.number, run.pk, ranks, finished_at=None, read_at=time.monotonic())
comm = [
    pending_batch(ref, row["rank"], 0, [{"kind": "comm", "time": time.time(), "step": steps,
                                          "payload": {**row, "window": [steps - COMM_WINDOW + 1, steps]}}])
    for row in rows
]
with mock.patch("loom.telemetry.store.publish"):
    store_batches(comm)
print(json.dumps({"run": run.pk, "seed_steps_s": seeded_steps, "seed_all_s": time.monotonic() - started}))
"""


def page_load(page, url: str, path: str) -> dict:
    """Open the run page. Timed from navigation: the page holding its snapshot (every chart's answer in and
    the events up to it applied: `window.loomRun.snapshotSeq` set) with the rank × step heatmap and both
    per-rank panels drawn (the page records a panel when it draws it); then the traffic matrix, which the
    page loads beside the snapshot without waiting for it. Also each API answer's time as the page's own
    requests saw it."""
    answers = {}

    def answered(request):
        if "/api/" in request.url:
            answers[request.url.split("/api/", 1)[1].split("?")[0]] = request.timing["responseEnd"]

    page.on("requestfinished", answered)
    page.goto(f"{url}{path}", wait_until="commit")
    page.wait_for_function(
        """() => window.loomRun && window.loomRun.snapshotSeq !== null && window.loomRun.panels.heatmap !== null
            && Object.keys(window.loomRun.panels.ranks).length === 2""",
        polling="raf",
        timeout=120_000,
    )
    drawn = page.evaluate("performance.now()")
    heatmap_columns = page.evaluate("() => window.loomRun.panels.heatmap.steps")
    page.wait_for_function("() => window.loomRun.panels.comm !== null", polling="raf", timeout=120_000)
    comm = page.evaluate("performance.now()")
    page.remove_listener("requestfinished", answered)
    return {"drawn_ms": drawn, "comm_ms": comm, "heatmap_columns": heatmap_columns, "answers_ms": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--loads", type=int, default=5, help="page loads to take the median of")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    from trainer.config import parse_config
    from trainer.plan.hardware import ClusterSpec
    from trainer.plan.traffic import predicted_rows

    config = run_config(args.ranks)
    cluster = ClusterSpec(nodes=max(1, args.ranks // 8), gpus_per_node=min(8, args.ranks))
    comm_rows = predicted_rows(parse_config(config), cluster)
    with tempfile.TemporaryDirectory(prefix="loom-page-bench-") as home:
        platform = Platform(Path(home), "postgres", debug=False, limit_concurrency=None)
        # A 1,024-rank world's rows are too long for an environment variable.
        comm_file = Path(home) / "comm_rows.json"
        comm_file.write_text(json.dumps(comm_rows))
        platform.create_database()
        try:
            platform.start()
            seeded = json.loads(
                platform.django(
                    SEED,
                    BENCH_RANKS=str(args.ranks),
                    BENCH_STEPS=str(args.steps),
                    BENCH_SLOW=str(SLOW_RANK),
                    BENCH_PASSWORD=PASSWORD,
                    BENCH_CONFIG=json.dumps(config),
                    BENCH_COMM_FILE=str(comm_file),
                )
                .strip()
                .splitlines()[-1]
            )
            print(
                f"seeded {args.ranks:,} ranks × {args.steps:,} steps = {args.ranks * args.steps:,} RankStep rows "
                f"in {seeded['seed_steps_s']:.0f} s (with tiles, hosts and comm {seeded['seed_all_s']:.0f} s)"
            )
            path = f"/runs/{seeded['run']}/"
            with sync_playwright() as playwright:
                browser, page = logged_in_page(playwright, platform.url, "bench", PASSWORD)
                loads = [page_load(page, platform.url, path) for _ in range(args.loads)]
                browser.close()
        finally:
            platform.stop()
            platform.drop_database()
    drawn = [load["drawn_ms"] for load in loads]
    comm = [load["comm_ms"] for load in loads]
    print(f"run page, navigation → snapshot drawn, ms: {', '.join(f'{ms:.0f}' for ms in drawn)}")
    print(f"run page, navigation → traffic matrix drawn, ms: {', '.join(f'{ms:.0f}' for ms in comm)}")
    print(f"heatmap columns drawn: {loads[-1]['heatmap_columns']:,} steps across (of {args.steps:,})")
    for name in sorted(loads[-1]["answers_ms"]):
        times = [load["answers_ms"].get(name) for load in loads if load["answers_ms"].get(name) is not None]
        print(f"  {name:<40} answered at {statistics.median(times):,.0f} ms (median, from the request's start)")
    median = statistics.median(drawn)
    verdict = "meets" if median <= 2000 else "misses"
    print(f"{args.ranks:,} ranks × {args.steps:,} steps: page drawn in {median / 1000:.2f} s (median of "
          f"{len(drawn)}), {verdict} the 2 s goal; traffic matrix {statistics.median(comm) / 1000:.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
