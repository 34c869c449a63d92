"""How long a crashed run takes to train again by itself (RTO), end to end through the real platform.

Starts the platform as `bin/up` does (uvicorn + a Celery worker with the embedded defaults: SQLite, a
file-system broker) in a temporary LOOM_HOME, so nothing else shares its database or queue. Creates, through
the HTTP API, the CPU demo model (layers 4, dim 128, dp_replicate 2) with a checkpoint every 5 steps and rank 1
SIGKILLed at step 7, waits until the automatic restart has finished the run, and prints the resilience figures
the platform computes (GET /api/runs/{id}/resilience): RTO (failure recorded → first step of the restarted
attempt), its parts (→ torchrun running → checkpoint loaded → first step), RPO in steps, ETTR, and RTO over
the 30 s goal (below 1: within).

    .venv/bin/python benchmarks/recovery_rto.py              # 3 runs, one after the other
    .venv/bin/python benchmarks/recovery_rto.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
GOAL_S = 30.0
TERMINAL = {"succeeded", "failed", "cancelled"}

CRASHING_DEMO = {
    "steps": 20,
    "model": {"layers": 4, "dim": 128, "heads": 4, "kv_heads": 2, "ffn": 344, "seq_len": 128},
    "parallel": {"dp_replicate": 2},
    "optimizer": {"lr": 0.003, "warmup_steps": 5},
    "data": {"micro_batch": 8, "corpus_bytes": 300_000},
    "checkpoint": {"interval_steps": 5},
    "faults": {"kill_at_step": 7, "kill_rank": 1},
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Platform:
    """The web process and a worker, as `bin/up` starts them, in a home of their own."""

    def __init__(self, home: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        inherited = {key: value for key, value in os.environ.items() if key not in ("DATABASE_URL", "REDIS_URL")}
        self.env = {**inherited, "LOOM_HOME": str(home), "LOOM_URL": self.url, "PYTHONUNBUFFERED": "1"}
        # DEBUG is off, as in a deployment: the platform needs a secret key of its own.
        self.env["LOOM_SECRET_KEY"] = secrets.token_urlsafe(50)
        self.home = home
        self.processes: list[subprocess.Popen] = []

    def manage(self, *args: str) -> str:
        command = [sys.executable, "manage.py", *args]
        return subprocess.run(command, cwd=ROOT, env=self.env, check=True, capture_output=True, text=True).stdout

    def start(self) -> str:
        self.manage("migrate", "--noinput")
        token = self.manage("create_api_user", "bench").strip()
        worker = [str(VENV_BIN / "celery"), "-A", "loom", "worker", "--pool", "threads", "--concurrency", "2"]
        worker += ["--loglevel", "WARNING"]
        web = [str(VENV_BIN / "uvicorn"), "loom.asgi:application", "--port", str(self.port), "--no-access-log"]
        for name, command in (("worker", worker), ("web", web)):
            log = open(self.home / f"{name}.log", "wb")  # noqa: SIM115 — open for the process's lifetime
            self.processes.append(subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=log, stderr=log))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.url}/login/", timeout=2)
                return token
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the web server did not start; see {self.home / 'web.log'}")

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.wait(timeout=60)


def api(platform: Platform, token: str, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(
        f"{platform.url}/api{path}",
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST" if body is not None else "GET",
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def timestamp(text: str | None) -> float | None:
    return datetime.fromisoformat(text).timestamp() if text else None


def recovery_parts(platform: Platform, token: str, run_id: int) -> dict:
    """Where the restarted attempt's time went: from the failure to queued, running, loaded, first step."""
    events = api(platform, token, f"/runs/{run_id}/events?limit=5000")["events"]
    failed = next(e["time"] for e in events if e["kind"] == "state" and e["payload"].get("state") == "failed")
    second = [e for e in events if e["attempt"] == 2]
    running = next(e["time"] for e in second if e["kind"] == "state" and e["payload"].get("state") == "running")
    loaded = next(e["time"] for e in second if e["kind"] == "checkpoint" and e["payload"].get("state") == "loaded")
    first_step = min(e["time"] for e in second if e["kind"] == "metric" and e["rank"] == 0)
    return {
        "to torchrun running": running - failed,
        "to checkpoint loaded": loaded - running,
        "to first step": first_step - loaded,
    }


def one_run(platform: Platform, token: str, index: int) -> dict:
    run = api(platform, token, "/runs", {"name": f"rto {index}", "config": CRASHING_DEMO})
    deadline = time.monotonic() + 600
    while True:
        detail = api(platform, token, f"/runs/{run['id']}")
        if detail["state"] in TERMINAL:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"run {run['id']} did not end in 10 minutes")
        time.sleep(0.5)
    if detail["state"] != "succeeded" or len(detail["attempts"]) != 2:
        raise RuntimeError(f"expected one failure and one successful restart, got {detail['attempts']}")
    figures = api(platform, token, f"/runs/{run['id']}/resilience")
    return {"figures": figures, "parts": recovery_parts(platform, token, run["id"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="loom-rto-") as home:
        platform = Platform(Path(home))
        token = platform.start()
        try:
            results = [one_run(platform, token, index) for index in range(args.runs)]
        finally:
            platform.stop()
    print(f"{'run':>4} {'RTO s':>7} {'RPO steps':>10} {'ETTR':>6} {'stall s':>8}  parts of the RTO (s)")
    for index, result in enumerate(results):
        figures, (failure,) = result["figures"], result["figures"]["failures"]
        parts = "  ".join(f"{name} {seconds:.2f}" for name, seconds in result["parts"].items())
        stall = figures["checkpoint_stall_s"]["mean"]
        rto, rpo, ettr = failure["rto_s"], failure["rpo_steps"], figures["ettr"]
        print(f"{index:>4} {rto:>7.2f} {rpo:>10} {ettr:>6.3f} {stall:>8.3f}  {parts}")
    median_rto = statistics.median(result["figures"]["failures"][0]["rto_s"] for result in results)
    print(f"median RTO {median_rto:.2f} s; RTO / goal {GOAL_S:.0f} s = {median_rto / GOAL_S:.2f} (below 1: within)")


if __name__ == "__main__":
    main()
