"""Live telemetry at cluster scale: N simulated ranks posting to the real ingest API at 1 Hz each.

Starts the web process as `bin/up` does (uvicorn `loom.asgi:application`, no Celery worker; LOOM_DEBUG=0 as
the deployment image sets it, `--debug` for 1) in a temporary LOOM_HOME, on SQLite (`--database embedded`)
or on a database of its own, `loom_bench_<pid>`, created on the PostgreSQL server of DATABASE_URL and dropped
afterwards (`--database postgres`; with REDIS_URL set, channels_redis on database 15 of that server, so its
groups never meet another process's). The run (N ranks) and its attempt are created by the run service with
the launch left unqueued, the attempt is claimed as the launcher claims it, and the attempt token minted then
is what every simulated rank sends with.

Each rank, started staggered over the first period so the load is even, cuts one batch per period (`--rate`
Hz), numbered (`seq`) and encoded as trainer/telemetry.py does: a `metric` event with the fields
trainer/train.py sends on a GPU (the state bytes too at step 1), a `heartbeat`, and every `--comm-every`
steps a `comm` event, the rank's row of the planner's predicted traffic matrix (trainer/plan/traffic.py, the
payload trainer/comm.py sends) summed over the window. A rank sends its batches oldest first, one at a time,
over one kept-alive connection per rank as the trainer's client does (`--connection-per-batch`: a new
connection for each, as the trainer's client did before); a batch is retried with the same seq and the
client's backoff until the platform answers 200 (a retry of a stored batch is answered `duplicate`) or
refuses it for good (400, 401, 403, 413); a request times out after the client's 10 s. Batches the server
is too slow for wait on the client, as in the trainer's spool; after `--duration` seconds of load the ranks
keep sending until all is delivered or `--drain-limit` s pass.

A point is one stored value: each numeric field of a `metric` payload, one per `heartbeat`, and each entry of
a `comm` payload's `sends` (one destination of the rank's traffic-matrix row). Stored points are counted from
the Event table afterwards, by (rank, kind, step): points lost = offered points neither stored nor still
waiting on the client at the drain limit (must be 0); an event stored twice is counted apart.

Reported: batches and points offered, sent and stored per second during the load and in a steady second;
whether the server kept up (a batch acknowledged within one period of being cut); request latency (send →
200) and delivery delay (cut → 200) percentiles; answers by status; the client backlog; the server's threads
and CPU; then, one request at a time after the load, where one ingest's time goes.

With `--follow`, a user's headless Chromium (benchmarks/browser.py) has the run page open through the load,
scrolled to its Ranks section (per-rank step time and memory; the page redraws only the charts in view),
and the page's own measurements are reported: for each point it drew from a live event, the time from the
event's emit (its `time`: here the moment its batch was cut and sent, so no flush wait is in it) to the
frame that drew it, for the loss chart (a step's first report) and for the step-time and memory bands
(every rank's point), with the websocket messages it received and the gaps it had to resync.

With `--ingest-process` the ranks post to a second web process (the same application on a port of its own),
so ingest shares its GIL and event loop with neither the page's websocket nor its chart requests; stored
events reach the page's process through Redis. Server CPU and threads are then both processes' sums.

`--limit-concurrency` passes uvicorn's limit on requests in flight (503 above it, retried by the client).

    .venv/bin/python benchmarks/ingest_load.py --ranks 64 --duration 10
    .venv/bin/python benchmarks/ingest_load.py                               # 1,024 ranks, 30 s, SQLite
    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test REDIS_URL=redis://127.0.0.1:6379/0 \\
        .venv/bin/python benchmarks/ingest_load.py --duration 60 --steps-per-batch 2 --follow
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import json
import math
import os
import random
import re
import resource
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from browser import RunPageFollower  # noqa: E402 — the benchmarks folder is on the path (it is the script's)

from trainer.config import parse_config  # noqa: E402 — the repository root is on the path only now
from trainer.ingest_connection import REJECTED_STATUSES  # noqa: E402
from trainer.plan.hardware import ClusterSpec  # noqa: E402
from trainer.plan.traffic import MAX_RANKS, predicted_rows  # noqa: E402
from trainer.telemetry import REQUEST_TIMEOUT_S, backoff_delay, batch_body, encode_event  # noqa: E402

VENV_BIN = Path(sys.executable).parent
BENCH_REDIS_DB = 15
LOGGED_ERROR = re.compile(r"^[\w.]+(Error|Exception|Timeout)\b")
GPUS_PER_NODE = 8
BENCH_PASSWORD = "ingest-load-password"
# After the load, how long a following page gets to draw the last points.
FOLLOW_SETTLE_S = 5.0
# Batches timed one at a time after the load, per kind of timing.
PROBES = 100

SETUP = """
import json, os
from unittest import mock
from django.contrib.auth import get_user_model
from loom.runs import services
from loom.runs.launcher import claim_attempt
user = get_user_model().objects.create_user("ingest-load", password=os.environ["BENCH_PASSWORD"])
with mock.patch("loom.runs.services.send_launch") as delay:
    run = services.create_run(user, os.environ["BENCH_RUN_NAME"], json.loads(os.environ["BENCH_CONFIG"]))
assert delay.call_count == 1
attempt, token = claim_attempt(run.attempts.get().pk)
print(json.dumps({"run": run.pk, "attempt": attempt.pk, "token": token}))
"""

STORED = """
import json, os
from loom.telemetry.models import Event, IngestBatch
attempt = int(os.environ["BENCH_ATTEMPT"])
rows = Event.objects.filter(attempt_id=attempt, rank__gte=0).values_list(
    "rank", "kind", "step", "received_at", "payload")
events = [[rank, kind, step, received.timestamp(), payload] for rank, kind, step, received, payload in rows]
with open(os.environ["BENCH_OUT"], "w") as out:
    json.dump({"events": events, "batches": IngestBatch.objects.filter(attempt_id=attempt).count()}, out)
"""

# The server's parts of one ingest, timed one batch at a time in one process on the same database: the token
# lookup (cached per process after the first), parsing and validation, and a transaction of one batch (the
# server's group commit writes many batches in one). The fan-out is left out: outside the server, async_to_sync
# would run each group_send on an event loop (and a Redis connection) of its own, which the server does not.
BREAKDOWN = """
import json, os, statistics, time
from unittest import mock
from loom.telemetry import services, store
from loom.telemetry.ingest import read_batch
parts = {"token lookup (cached)": [], "parse and validate": [], "store (one batch a transaction)": []}
bodies = json.load(open(os.environ["BENCH_BODIES"]))
with mock.patch.object(store, "publish"):
    for body in bodies:
        started = time.perf_counter()
        attempt = services.attempt_for_token(os.environ["BENCH_TOKEN"])
        parts["token lookup (cached)"].append(time.perf_counter() - started)
        started = time.perf_counter()
        batch = read_batch(attempt, body.encode())
        parts["parse and validate"].append(time.perf_counter() - started)
        started = time.perf_counter()
        store.store_batches([batch])
        parts["store (one batch a transaction)"].append(time.perf_counter() - started)
print(json.dumps({name: statistics.median(values) for name, values in parts.items()}))
"""


def run_loop(main: Coroutine) -> dict:
    """uvloop where it is installed (uvicorn brings it): the generator must not be the bottleneck."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def points_of(kind: str, payload: dict) -> int:
    """Stored values in one event (the module docstring's definition of a point)."""
    if kind == "metric":
        return sum(1 for value in payload.values() if isinstance(value, int | float) and not isinstance(value, bool))
    if kind == "comm":
        return len(payload["sends"])
    return 1


def run_config(ranks: int) -> dict:
    """A tiny model in a cluster-scale layout: tp 8 in a node, pp 4, FSDP over the rest when the ranks
    allow it (32 | N), else plain DDP over N ranks. The model's size does not matter: nothing trains."""
    if ranks % 32 == 0:
        parallel = {"tp": 8, "pp": 4, "dp_shard": ranks // 32, "microbatches": 4}
    else:
        parallel = {"dp_replicate": ranks}
    model = {"layers": 8, "dim": 256, "heads": 8, "kv_heads": 8, "ffn": 688, "seq_len": 128}
    return {"steps": 1_000_000, "model": model, "parallel": parallel, "data": {"micro_batch": 4}}


def comm_rows(config: dict, ranks: int) -> list[dict]:
    """Each rank's `comm` payload for one step, as the planner predicts what trainer/comm.py records."""
    nodes = max(1, math.ceil(ranks / GPUS_PER_NODE))
    cluster = ClusterSpec(nodes=nodes, gpus_per_node=min(ranks, GPUS_PER_NODE))
    return predicted_rows(parse_config(config), cluster)


class Platform:
    """The web process as `bin/up` starts it (no worker), in a home and on a database of its own; with
    `ingest_process`, a second one (the same application) that the ranks post to, so ingest shares no
    process with the page, its websocket and its chart requests (events reach the page through Redis)."""

    def __init__(
        self, home: Path, database: str, debug: bool, limit_concurrency: int | None, ingest_process: bool = False
    ):
        self.home = home
        self.port = free_port()
        self.ingest_port = free_port() if ingest_process else self.port
        self.url = f"http://127.0.0.1:{self.port}"
        inherited = {key: value for key, value in os.environ.items() if key not in ("DATABASE_URL", "REDIS_URL")}
        self.env = {**inherited, "LOOM_HOME": str(home), "LOOM_URL": self.url, "LOOM_DEBUG": "1" if debug else "0"}
        # With DEBUG off the platform needs a secret key; the benchmarks' ranks are played by the benchmark, never
        # started, so the launch limits on world size and a user's ranks are lifted.
        self.env |= {
            "LOOM_SECRET_KEY": secrets.token_urlsafe(50),
            "LOOM_LOCAL_CPU_SLOTS": "1000000",
            "LOOM_USER_MAX_RANKS": "1000000",
        }
        self.limit_concurrency = limit_concurrency
        self.env["PYTHONUNBUFFERED"] = "1"
        self.server_url = None
        self.database_name = None
        self.channel_layer = "in-memory"
        if database == "postgres":
            self.server_url = os.environ["DATABASE_URL"]
            self.database_name = f"loom_bench_{os.getpid()}"
            self.env["DATABASE_URL"] = urlparse(self.server_url)._replace(path=f"/{self.database_name}").geturl()
            if os.environ.get("REDIS_URL"):
                redis = urlparse(os.environ["REDIS_URL"])._replace(path=f"/{BENCH_REDIS_DB}").geturl()
                self.env["REDIS_URL"] = redis
                self.channel_layer = f"channels_redis ({redis})"
        self.processes: list[subprocess.Popen] = []

    def _postgres(self, statement: str) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.server_url, autocommit=True) as connection:
            connection.execute(sql.SQL(statement).format(sql.Identifier(self.database_name)))

    def create_database(self) -> None:
        if self.database_name:
            self._postgres("CREATE DATABASE {}")

    def drop_database(self) -> None:
        if self.database_name:
            self._postgres("DROP DATABASE IF EXISTS {} WITH (FORCE)")

    def django(self, code: str, **env: str) -> str:
        """Run a snippet with Django set up (manage.py shell) against this platform's database."""
        command = [sys.executable, "manage.py", "shell", "--no-imports", "-c", code]
        done = subprocess.run(command, cwd=ROOT, env={**self.env, **env}, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"manage.py shell failed:\n{done.stderr}")
        return done.stdout

    def migrate(self) -> None:
        command = [sys.executable, "manage.py", "migrate", "--noinput"]
        subprocess.run(command, cwd=ROOT, env=self.env, check=True, capture_output=True)

    def start(self) -> None:
        self.migrate()
        servers = [("web", self.port)] + ([("ingest", self.ingest_port)] if self.ingest_port != self.port else [])
        for name, port in servers:
            web = [str(VENV_BIN / "uvicorn"), "loom.asgi:application", "--port", str(port), "--no-access-log"]
            web += ["--timeout-graceful-shutdown", "10"]
            if self.limit_concurrency:
                web += ["--limit-concurrency", str(self.limit_concurrency)]
            log = open(self.home / f"{name}.log", "wb")  # noqa: SIM115 — open for the process's lifetime
            self.processes.append(subprocess.Popen(web, cwd=ROOT, env=self.env, stdout=log, stderr=log))
            self._wait_for(f"http://127.0.0.1:{port}/login/", name)

    def _wait_for(self, url: str, name: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(url, timeout=2)
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the {name} server did not start; see {self.home / f'{name}.log'}")

    def threads(self) -> int:
        total = 0
        for process in self.processes:
            status = Path(f"/proc/{process.pid}/status").read_text()
            total += int(re.search(r"^Threads:\s+(\d+)", status, re.MULTILINE)[1])
        return total

    def cpu_seconds(self) -> float:
        total = 0
        for process in self.processes:
            fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
            process.wait(timeout=60)

    def logged_errors(self) -> collections.Counter:
        """The exceptions the web processes logged (a traceback's last line), by text."""
        lines = []
        for log in (self.home / "web.log", self.home / "ingest.log"):
            lines += log.read_text(errors="replace").splitlines() if log.exists() else []
        return collections.Counter(line[:200] for line in lines if LOGGED_ERROR.match(line))


def machine_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores."""
    values = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    total = sum(values[:8])
    tick = os.sysconf("SC_CLK_TCK")
    return (total - idle) / tick, total / tick


class HttpError(Exception):
    pass


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """One HTTP/1.1 response: status, body and whether the server will close the connection."""
    status_line = await reader.readline()
    if not status_line:
        raise HttpError("connection closed before a response")
    status = int(status_line.split()[1])
    length, chunked, close = None, False, False
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value
        elif name == b"connection":
            close = value == b"close"
    if chunked:
        body = b""
        while size := int((await reader.readline()).split(b";")[0], 16):
            body += await reader.readexactly(size + 2)
        await reader.readline()
        return status, body, close
    if length is None:
        return status, await reader.read(), True
    return status, await reader.readexactly(length), close


@dataclass
class Batch:
    seq: int
    body: bytes
    points: int
    keys: dict[tuple[int, str, int], int]
    generated: float
    sent: bool = False


@dataclass
class Stats:
    latencies: list[float] = field(default_factory=list)
    # When each of them ended, in seconds since the load started.
    latency_ends: list[float] = field(default_factory=list)
    delivery_delays: list[float] = field(default_factory=list)
    generation_lags: list[float] = field(default_factory=list)
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    generated: int = 0
    generated_points: int = 0
    acked_in_window: int = 0
    acked_within_period: int = 0
    duplicates: int = 0
    refused_points: int = 0
    first_sends_in_window: int = 0
    backlog: list[int] = field(default_factory=list)
    server_threads: list[int] = field(default_factory=list)
    # (rank, kind, step) → points of every event generated; each is generated once.
    offered: dict = field(default_factory=dict)


class Rank:
    """One simulated rank: cuts a numbered batch every period and sends its queue oldest first."""

    def __init__(self, load: Load, rank: int):
        self.load = load
        self.rank = rank
        self.queue: collections.deque[Batch] = collections.deque()
        self.ready = asyncio.Event()
        self.done_producing = False
        self.connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.failures = 0
        self.host = f"node{rank // GPUS_PER_NODE:04d}"

    def batch(self, index: int) -> Batch:
        load, now = self.load, time.time()
        per_batch = load.args.steps_per_batch
        events = []
        last = (index + 1) * per_batch
        for step in range(index * per_batch + 1, last + 1):
            events.append(("metric", self.metric(step), step))
            if load.comm_rows and step % load.args.comm_every == 0:
                events.append(("comm", self.comm(step), step))
        events.append(("heartbeat", {"pid": 10_000 + self.rank, "host": self.host}, last))
        lines = [encode_event(kind, payload, step, now) for kind, payload, step in events]
        body = batch_body(load.attempt, self.rank, index, lines)
        points = {(self.rank, kind, step): points_of(kind, payload) for kind, payload, step in events}
        return Batch(index, body, sum(points.values()), points, now)

    def metric(self, step: int) -> dict:
        load = self.load
        step_time = random.gauss(1.0, 0.02) / (load.args.rate * load.args.steps_per_batch)
        metric = {
            "loss_mean": 6.0 * math.exp(-step / 500) + 2.0,
            "loss": 6.0 * math.exp(-step / 500) + 2.0 + random.gauss(0, 0.05),
            "grad_norm": abs(random.gauss(1.0, 0.2)),
            "lr": 3e-4 * min(1.0, step / 100),
            "step_time_s": step_time,
            "tokens_per_s": 4 * 128 / step_time,
            "tokens": step * 4 * 128,
            "mfu": random.uniform(0.38, 0.42),
            "memory_allocated": 41_000_000_000 + random.randrange(1_000_000),
            "memory_peak": 62_000_000_000,
            "memory_reserved": 66_000_000_000,
        }
        if step == 1:
            metric |= {
                "parameter_bytes": 2_100_000_000,
                "gradient_bytes": 2_100_000_000,
                "optimizer_bytes": 8_400_000_000,
            }
        return metric

    def comm(self, step: int) -> dict:
        load = self.load
        first = step - load.args.comm_every + 1
        row = load.comm_rows[self.rank]
        sends = [
            [dst, nbytes * load.args.comm_every, kind, ops * load.args.comm_every]
            for dst, nbytes, kind, ops in row["sends"]
        ]
        ops = {op: count * load.args.comm_every for op, count in row["ops"].items()}
        comm = {
            **row,
            "window": [first, step],
            "sends": sends,
            "ops": ops,
            "time_s": round(0.05 * load.args.comm_every / (load.args.rate * load.args.steps_per_batch), 6),
        }
        return comm

    async def produce(self) -> None:
        load, period = self.load, 1.0 / self.load.args.rate
        offset = period * self.rank / load.args.ranks
        for index in range(load.batches_per_rank):
            due = load.started + offset + index * period
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            load.stats.generation_lags.append(time.monotonic() - due)
            batch = self.batch(index)
            self.queue.append(batch)
            load.stats.generated += 1
            load.stats.generated_points += batch.points
            load.stats.offered |= batch.keys
            self.ready.set()
        self.done_producing = True
        self.ready.set()

    async def send(self) -> None:
        stats = self.load.stats
        while True:
            if not self.queue:
                if self.done_producing:
                    return
                self.ready.clear()
                await self.ready.wait()
                continue
            batch = self.queue[0]
            started = time.monotonic()
            if not batch.sent and started < self.load.window_end:
                stats.first_sends_in_window += 1
            batch.sent = True
            try:
                status, body = await asyncio.wait_for(self.post(batch.body), REQUEST_TIMEOUT_S)
            except (OSError, HttpError, asyncio.IncompleteReadError, TimeoutError) as error:
                self.close()
                stats.outcomes[type(error).__name__] += 1
                await self.back_off()
                continue
            stats.outcomes[status] += 1
            if status == 200:
                finished = time.monotonic()
                stats.latencies.append(finished - started)
                stats.latency_ends.append(finished - self.load.started)
                stats.delivery_delays.append(delay := time.time() - batch.generated)
                stats.acked_within_period += delay <= 1.0 / self.load.args.rate
                stats.acked_in_window += finished < self.load.window_end
                stats.duplicates += json.loads(body)["duplicate"]
                self.queue.popleft()
                self.failures = 0
            elif status in REJECTED_STATUSES:
                stats.refused_points += batch.points
                self.queue.popleft()
            else:
                await self.back_off()

    async def back_off(self) -> None:
        self.failures += 1
        await asyncio.sleep(backoff_delay(self.failures))

    async def post(self, body: bytes, token: str | None = None) -> tuple[int, bytes]:
        load = self.load
        if self.connection is None:
            self.connection = await asyncio.open_connection("127.0.0.1", load.port)
        reader, writer = self.connection
        head = (
            f"POST /api/ingest HTTP/1.1\r\nHost: 127.0.0.1:{load.port}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {token or load.token}\r\nContent-Length: {len(body)}\r\n"
            f"Connection: {'close' if load.args.connection_per_batch else 'keep-alive'}\r\n\r\n"
        )
        writer.write(head.encode() + body)
        status, response, close = await read_response(reader)
        if close or load.args.connection_per_batch:
            self.close()
        return status, response

    def close(self) -> None:
        if self.connection is not None:
            self.connection[1].close()
            self.connection = None


class Load:
    def __init__(self, args: argparse.Namespace, platform: Platform, attempt: int, token: str, comm_rows: list[dict]):
        self.args = args
        self.platform = platform
        self.port = platform.ingest_port
        self.attempt = attempt
        self.token = token
        self.comm_rows = comm_rows
        self.batches_per_rank = max(1, round(args.duration * args.rate))
        self.window_s = self.batches_per_rank / args.rate
        self.stats = Stats()
        self.started = 0.0
        self.window_end = 0.0
        self.ranks: list[Rank] = []

    async def sample_backlog(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.stats.backlog.append(sum(len(rank.queue) for rank in self.ranks))
            self.stats.server_threads.append(self.platform.threads())

    async def run(self) -> dict:
        self.ranks = [Rank(self, rank) for rank in range(self.args.ranks)]
        self.started = time.monotonic() + 0.5
        self.window_end = self.started + self.window_s
        sampler = asyncio.create_task(self.sample_backlog())
        producers = [asyncio.create_task(rank.produce()) for rank in self.ranks]
        senders = [asyncio.create_task(rank.send()) for rank in self.ranks]
        await asyncio.gather(*producers)
        await asyncio.sleep(max(0.0, self.window_end - time.monotonic()))
        backlog_at_end = sum(len(rank.queue) for rank in self.ranks)
        _, pending = await asyncio.wait(senders, timeout=self.args.drain_limit)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        sampler.cancel()
        for rank in self.ranks:
            rank.close()
        return {
            "backlog_at_end": backlog_at_end,
            "undelivered": sum(len(rank.queue) for rank in self.ranks),
            "spooled": {key for rank in self.ranks for batch in rank.queue for key in batch.keys},
        }


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1)]


def stored_figures(platform: Platform, load: Load, started_wall: float, spooled: set) -> dict:
    """What the Event table holds for the attempt, against what was offered; a batch still waiting on the
    client at the drain limit is not lost (the trainer's spool would deliver it later)."""
    out = platform.home / "stored.json"
    platform.django(STORED, BENCH_ATTEMPT=str(load.attempt), BENCH_OUT=str(out))
    stored = json.loads(out.read_text())
    events, window = stored["events"], load.window_s
    keys = collections.Counter((rank, kind, step) for rank, kind, step, _, _ in events)
    per_second = collections.Counter()
    for _, kind, _, received, payload in events:
        per_second[math.floor(received - started_wall)] += points_of(kind, payload)
    steady = [per_second.get(second, 0) for second in range(2, math.floor(window))]
    offered = load.stats.offered
    return {
        "events": len(events),
        "batches": stored["batches"],
        "points": sum(points_of(kind, payload) for _, kind, _, _, payload in events),
        "points_in_window": sum(count for second, count in per_second.items() if 0 <= second < window),
        "steady_median": statistics.median(steady) if steady else float("nan"),
        "last_received_s": max((event[3] for event in events), default=started_wall) - started_wall,
        "stored_twice": sum(count - 1 for count in keys.values()),
        "unexpected": sum(1 for key in keys if key not in offered),
        "lost_points": sum(points for key, points in offered.items() if key not in keys and key not in spooled),
    }


def breakdown(platform: Platform, load: Load) -> dict:
    """Where one ingest's time goes, one at a time once the load is over, with fresh batches of rank 0
    past its last seq: the server's parts timed in a process of their own, then whole requests."""
    rank = Rank(load, 0)
    indexes = range(load.batches_per_rank, load.batches_per_rank + PROBES)
    path = platform.home / "bodies.json"
    path.write_text(json.dumps([rank.batch(index).body.decode() for index in indexes]))
    parts = json.loads(platform.django(BREAKDOWN, BENCH_BODIES=str(path), BENCH_TOKEN=load.token))
    return parts | run_loop(one_request_at_a_time(load, rank))


async def one_request_at_a_time(load: Load, rank: Rank) -> dict:
    """Whole requests, uncontended: an ingest, and the same batch with an unknown token (401 after the
    token lookup, nothing stored), which is the HTTP and Django path with one query."""
    timings = {"whole request": [], "same, unknown token": []}
    for index in range(load.batches_per_rank + PROBES, load.batches_per_rank + 2 * PROBES):
        body = rank.batch(index).body
        for name, token, expected in (("same, unknown token", "unknown", 401), ("whole request", load.token, 200)):
            started = time.monotonic()
            status, _ = await rank.post(body, token)
            timings[name].append(time.monotonic() - started)
            if status != expected:
                raise RuntimeError(f"a request alone was answered {status}, expected {expected}")
    rank.close()
    return {name: statistics.median(values) for name, values in timings.items()}


def p95_by_window(samples: Iterable[tuple[float, float]], window_s: float = 10.0) -> list[float]:
    """The p95 of the values in each window of the load, from (value, seconds into the load) pairs."""
    windows = collections.defaultdict(list)
    for value, at_s in samples:
        windows[int(at_s // window_s)].append(value)
    return [percentile(windows[index], 0.95) for index in sorted(windows)]


def latency_by_window(stats: Stats) -> str:
    p95s = p95_by_window(zip(stats.latencies, stats.latency_ends, strict=True))
    return ", ".join(f"{p95 * 1000:,.0f}" for p95 in p95s) + " ms"


def rate(count: float, seconds: float) -> str:
    return f"{count:,.0f} ({count / seconds:,.0f}/s)"


def report(
    args, platform: Platform, load: Load, outcome: dict, stored: dict, cpu: dict, parts: dict | None, page: dict | None
) -> None:
    stats, window = load.stats, load.window_s
    kept = stats.acked_within_period / max(1, stats.generated)
    period = 1.0 / args.rate
    latency = [percentile(stats.latencies, q) * 1000 for q in (0.5, 0.95, 0.99)]
    delays = [percentile(stats.delivery_delays, 0.5), percentile(stats.delivery_delays, 0.95)]
    delays.append(max(stats.delivery_delays, default=float("nan")))
    errors = ", ".join(f"{key}: {count:,}" for key, count in stats.outcomes.items() if key != 200) or "none"
    busy = cpu["seconds"]
    rows = [
        ("backend", f"{args.database}; channel layer {platform.channel_layer}"),
        ("load", f"{args.ranks} ranks × {args.rate:g} Hz for {window:g} s; comm every {args.comm_every} steps"),
        ("connections", "a new one per batch" if args.connection_per_batch else "one kept alive per rank, as trainers"),
        (
            "server",
            f"uvicorn{' × 2 (ingest apart)' if args.ingest_process else ''}, LOOM_DEBUG={int(args.debug)}, "
            f"--limit-concurrency {args.limit_concurrency or 'none'}",
        ),
        ("batches offered", rate(stats.generated, window)),
        ("points offered", rate(stats.generated_points, window)),
        ("batches first sent during the load", rate(stats.first_sends_in_window, window)),
        ("batches acknowledged during the load", rate(stats.acked_in_window, window)),
        ("points stored during the load", rate(stored["points_in_window"], window)),
        ("points stored in a steady second (median)", f"{stored['steady_median']:,.0f}"),
        ("kept up", f"{'yes' if kept >= 0.95 else 'no'}: {kept:.1%} of the batches acknowledged within {period:g} s"),
        ("client backlog at the end of the load", f"{outcome['backlog_at_end']:,} batches"),
        ("client backlog, largest sampled", f"{max(stats.backlog, default=0):,} batches"),
        ("last event stored at", f"{stored['last_received_s']:.1f} s (the load ended at {window:g} s)"),
        ("request latency p50 / p95 / p99", " / ".join(f"{value:,.0f} ms" for value in latency)),
        ("request latency p95 by 10 s of the load", latency_by_window(stats)),
        ("generated → acknowledged p50 / p95 / max", " / ".join(f"{value:,.2f} s" for value in delays)),
        ("answers other than 200", errors),
        ("retries answered duplicate", f"{stats.duplicates:,}"),
        ("stored batches / events / points", f"{stored['batches']:,} / {stored['events']:,} / {stored['points']:,}"),
        ("events stored twice / not offered", f"{stored['stored_twice']:,} / {stored['unexpected']:,}"),
        ("still waiting on the client at the drain limit", f"{outcome['undelivered']:,} batches"),
        ("refused for good (4xx)", f"{stats.refused_points:,} points"),
        ("points lost (offered, neither stored nor waiting)", f"{stored['lost_points']:,}"),
        ("server threads, largest sampled", f"{max(stats.server_threads, default=0):,}"),
        ("generator lag p95 (high: client starved)", f"{percentile(stats.generation_lags, 0.95) * 1000:,.0f} ms"),
        (
            "CPU until delivered: server, client / machine",
            f"{cpu['server'] / busy:.2f}, {cpu['client'] / busy:.2f} cores / {cpu['machine']:.0%} of"
            f" {os.cpu_count()} cores, over {busy:.1f} s",
        ),
        ("load average (1 min) before / after", f"{cpu['load_before']:.2f} / {cpu['load_after']:.2f}"),
    ]
    if parts:
        alone = {name: parts.pop(name) * 1000 for name in ("whole request", "same, unknown token")}
        parts_ms = ", ".join(f"{name} {value * 1000:.1f}" for name, value in parts.items())
        rows.append(("one ingest alone, in-process, median ms", f"{parts_ms}; sum {sum(parts.values()) * 1000:.1f}"))
        rows.append(("one at a time over HTTP, median ms", ", ".join(f"{n} {v:.1f}" for n, v in alone.items())))
    if page:
        rows += page_rows(page, stored)
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(
        f"{args.ranks} ranks on {args.database}: offered {stats.generated_points / window:,.0f} points/s, "
        f"stored {stored['points_in_window'] / window:,.0f} points/s during the load "
        f"({kept:.0%} of batches stored within {period:g} s); "
        f"latency p50 {latency[0]:,.0f} ms, p95 {latency[1]:,.0f} ms; points lost {stored['lost_points']:,}"
    )


def page_rows(page: dict, stored: dict) -> list[tuple[str, str]]:
    """What the page following the run drew, and how long each point took from its rank to the screen."""
    socket, fetched = page["socket"], page["fetched"]
    rows = []
    drawn_points = (
        ("loss points (a step's first report)", page["loss"]),
        ("step-time points", page["ranks"]),
        ("memory points", page["memory"]),
    )
    for name, values in drawn_points:
        figures = " / ".join(f"{percentile(values, q):,.0f} ms" for q in (0.5, 0.95, 0.99))
        drawn = f"{figures} over {len(values):,} points" if values else "none drawn live: the chart was out of view"
        rows.append((f"emit → drawn p50 / p95 / p99, {name}", drawn))
    for stage, name in enumerate(("emit → sent to the page", "sent → received", "received → drawn")):
        values = [stages[stage] for stages in page["rankStages"]]
        figures = " / ".join(f"{percentile(values, q):,.0f} ms" for q in (0.5, 0.95, 0.99))
        rows.append((f"  step-time points' {name} p50 / p95 / p99", f"{figures} over {len(values):,} points"))
    if page["rankStages"]:
        rows.append(("step-time points' emit → drawn p95 by 10 s", drawn_by_window(page["rankStages"])))
        rows += behind_heavy_work(page["rankStages"], page["heavyWork"])
    rows += [
        (
            "page: websockets opened / messages / events in them",
            f"{socket['opened']:,} / {socket['messages']:,} / {socket['events']:,}",
        ),
        ("page: gaps resynced / events fetched to fill them", f"{socket['gaps']:,} / {fetched['events']:,}"),
        ("page: last seq applied / events stored", f"{page['lastSeq']:,} / {stored['events']:,}"),
        ("page: notice shown at the end", page["notice"] or "none"),
        (
            "page: last heatmap / traffic answer + draw, ms",
            " / ".join(
                f"{costs['tookMs']:,.0f} + {costs['drawMs']:,.0f}"
                for costs in (page["refetchCosts"]["heatmap"], page["refetchCosts"]["comm"])
            ),
        ),
    ]
    return rows


def drawn_by_window(stages: list[list[float]]) -> str:
    """p95 emit → drawn of the points drawn in each window of the load: a steady tail or a few bad seconds."""
    first = min(point[3] for point in stages)
    p95s = p95_by_window((sum(point[:3]), (point[3] - first) / 1000) for point in stages)
    return ", ".join(f"{p95:,.0f}" for p95 in p95s) + " ms"


def behind_heavy_work(stages: list[list[float]], heavy: list[list]) -> list[tuple[str, str]]:
    """For each heavy panel's fetch and draw, the share of the step-time points slower than the p95 whose
    emit → drawn overlapped one, beside the share of all points that did: a tail share far above the
    overall share says that work makes the tail."""
    points = [(point[3] - sum(point[:3]), point[3]) for point in stages]
    cut = percentile([drawn - emitted for emitted, drawn in points], 0.95)
    late = [(emitted, drawn) for emitted, drawn in points if drawn - emitted > cut]
    rows = []
    for panel, part in sorted({(name, part) for name, part, *_ in heavy}):
        spans = sorted((start, end) for name, kind, start, end in heavy if (name, kind) == (panel, part))
        starts = [start for start, _ in spans]

        def overlaps(emitted: float, drawn: float, spans=spans, starts=starts) -> bool:
            index = bisect.bisect_left(starts, drawn) - 1
            return index >= 0 and spans[index][1] > emitted

        share_late = sum(overlaps(*point) for point in late) / max(1, len(late))
        share_all = sum(overlaps(*point) for point in points) / max(1, len(points))
        busy = sum(end - start for start, end in spans) / 1000
        rows.append(
            (
                f"  points over the p95 behind a {panel} {part}",
                f"{share_late:.0%} (all points: {share_all:.0%}); {len(spans)} of them, {busy:.1f} s in all",
            )
        )
    return rows


def cpu_during(platform: Platform, run: Callable[[], dict]) -> tuple[dict, dict]:
    """run()'s result and the CPU it took: the server's, this process's and the machine's share."""
    load_before = os.getloadavg()[0]
    server, client = platform.cpu_seconds(), resource.getrusage(resource.RUSAGE_SELF)
    busy, total, started = *machine_busy_seconds(), time.monotonic()
    result = run()
    client_after = resource.getrusage(resource.RUSAGE_SELF)
    busy_after, total_after = machine_busy_seconds()
    return result, {
        "seconds": time.monotonic() - started,
        "server": platform.cpu_seconds() - server,
        "client": client_after.ru_utime + client_after.ru_stime - client.ru_utime - client.ru_stime,
        "machine": (busy_after - busy) / max(1e-9, total_after - total),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    parser.add_argument("--rate", type=float, default=1.0, help="batches per rank per second")
    parser.add_argument("--comm-every", type=int, default=10, help="steps per comm event; 0: none")
    parser.add_argument(
        "--database", choices=["embedded", "postgres"], help="default: postgres when DATABASE_URL is set"
    )
    parser.add_argument(
        "--steps-per-batch",
        type=int,
        default=1,
        help="training steps each batch reports (a trainer flushing every second at that many steps a second)",
    )
    parser.add_argument("--connection-per-batch", action="store_true", help="a new connection for each batch")
    parser.add_argument("--drain-limit", type=float, default=120.0, help="seconds to keep delivering after the load")
    parser.add_argument(
        "--limit-concurrency", type=int, help="uvicorn's limit on requests in flight (503 above it); default none"
    )
    parser.add_argument("--debug", action="store_true", help="LOOM_DEBUG=1 as bin/up: 500s logged with tracebacks")
    parser.add_argument("--no-breakdown", action="store_true", help="do not time the server's parts afterwards")
    parser.add_argument(
        "--follow", action="store_true", help="a user's headless Chromium follows the run page through the load"
    )
    parser.add_argument(
        "--ingest-process",
        action="store_true",
        help="ranks post to a second web process of their own (needs PostgreSQL and REDIS_URL)",
    )
    args = parser.parse_args()
    args.database = args.database or ("postgres" if os.environ.get("DATABASE_URL") else "embedded")
    if args.database == "postgres" and not os.environ.get("DATABASE_URL"):
        parser.error("--database postgres needs DATABASE_URL=postgresql://…")
    if args.ingest_process and not (args.database == "postgres" and os.environ.get("REDIS_URL")):
        parser.error("--ingest-process needs PostgreSQL and REDIS_URL: the page's process hears ingest through Redis")
    if args.comm_every and args.ranks > MAX_RANKS:
        parser.error(f"comm rows come from the planner's matrix, which covers up to {MAX_RANKS} ranks; --comm-every 0")
    config = run_config(args.ranks)
    rows = comm_rows(config, args.ranks) if args.comm_every else []
    entries = statistics.mean(len(row["sends"]) for row in rows) if rows else 0
    print(f"layout {config['parallel']}; comm row: {entries:.1f} destinations per rank on average")
    # Each rank holds a connection open; the server holds the other end.
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    with tempfile.TemporaryDirectory(prefix="loom-ingest-") as home:
        platform = Platform(Path(home), args.database, args.debug, args.limit_concurrency, args.ingest_process)
        platform.create_database()
        try:
            platform.start()
            setup_env = {"BENCH_RUN_NAME": f"ingest load {args.ranks}", "BENCH_CONFIG": json.dumps(config)}
            created = json.loads(platform.django(SETUP, BENCH_PASSWORD=BENCH_PASSWORD, **setup_env))
            load = Load(args, platform, created["attempt"], created["token"], rows)
            follower = None
            if args.follow:
                follower = RunPageFollower(platform.url, created["run"], "ingest-load", BENCH_PASSWORD)
                follower.start()
            started_wall = time.time() - time.monotonic()
            outcome, cpu = cpu_during(platform, lambda: run_loop(load.run()))
            page = follower.finish(FOLLOW_SETTLE_S) if follower else None
            stored = stored_figures(platform, load, started_wall + load.started, outcome["spooled"])
            parts = None if args.no_breakdown else breakdown(platform, load)
        finally:
            platform.stop()
            errors = platform.logged_errors()
            platform.drop_database()
    report(args, platform, load, outcome, stored, cpu, parts, page)
    for line, count in errors.most_common(5):
        print(f"web.log: {count:,} × {line}")


if __name__ == "__main__":
    main()
