"""The platform as docker/compose.yaml lays it out (web, launch worker, monitor worker with Celery beat,
PostgreSQL, Redis), as subprocesses of a test, on a PostgreSQL and a Redis of the test's own.

Fault tests stop, restart and kill these pieces; the machine's own PostgreSQL (5432) and Redis (6379)
belong to CI and are never touched. Every process the deployment starts carries a marker in its
environment, inherited by whatever it starts in turn (torchrun, its supervisor, the ranks), so the
deployment finds and stops its processes however they were detached or reparented."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import psycopg
import redis
from psycopg.rows import dict_row

REPO_ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
# initdb refuses to run as root; PostgreSQL's own OS user owns the private cluster instead.
POSTGRES_OS_USER = "postgres"
MARKER_VARIABLE = "LOOM_TEST_DEPLOYMENT"
START_TIMEOUT_S = 90.0
STOP_GRACE_S = 15.0
# Settings of the deployment that the machine's environment (CI's DATABASE_URL, a developer's LOOM_HOME)
# must not leak into.
FOREIGN_SETTINGS = ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")
# /proc/<pid>/stat fields from the third on: state (0), …, start time in clock ticks since boot (19).
STATE_FIELD = 0
START_TIME_FIELD = 19


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate, timeout: float, message: str, interval: float = 0.2):
    """Poll until predicate() returns something truthy and return it; fail naming what never happened."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {message}")
        time.sleep(interval)


def postgres_bin(program: str) -> str:
    """A PostgreSQL server program: on PATH, or in Debian's versioned directory, which is not on it."""
    found = shutil.which(program) or next(
        (str(path) for path in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{program}"), reverse=True)), None
    )
    if found is None:
        raise RuntimeError(f"{program} not found: install PostgreSQL's server package (Debian: postgresql)")
    return found


def stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name (which may hold spaces and parentheses); None once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_alive(pid: int, start_time: str | int | None = None) -> bool:
    """Whether pid runs (a zombie has ended: only its exit status is left to collect) and, given its start
    time in clock ticks, is still that process rather than a later one that reused the pid."""
    fields = stat_fields(pid)
    if fields is None or fields[STATE_FIELD] == "Z":
        return False
    return start_time is None or fields[START_TIME_FIELD] == str(start_time)


def environment_of(pid: int) -> dict[str, str]:
    """The environment a process started with; empty for one that is gone or a zombie."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (entry.partition(b"=") for entry in raw.split(b"\0") if entry)
    return {name.decode(errors="replace"): value.decode(errors="replace") for name, _, value in pairs}


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def live_processes_where(**environment) -> list[int]:
    """Running processes (zombies excluded) whose starting environment holds every given variable."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        if pid == os.getpid() or not process_alive(pid):
            continue
        variables = environment_of(pid)
        if variables and all(variables.get(name) == value for name, value in environment.items()):
            found.append(pid)
    return found


def signal_quietly(pid: int, sig: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class PrivatePostgres:
    """A PostgreSQL cluster of the test's own in a temporary directory, on a free port, with one database."""

    def __init__(self, database: str = "loom"):
        self.database = database
        self.port = free_port()
        # Not under pytest's tmp_path: its parents are root's alone, and the server runs as another user.
        self.root = Path(tempfile.mkdtemp(prefix="loom-private-postgres-"))
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self._running = False
        if os.geteuid() == 0:
            shutil.chown(self.root, POSTGRES_OS_USER)
        try:
            self._as_server_user(
                postgres_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                "--no-sync",
            )  # fmt: skip
            self.start()
            with psycopg.connect(self.url_of("postgres"), autocommit=True) as connection:
                connection.execute(f'CREATE DATABASE "{database}"')
        except BaseException:
            self.close()
            raise

    @property
    def running(self) -> bool:
        return self._running

    def url_of(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    @property
    def url(self) -> str:
        return self.url_of(self.database)

    def start(self) -> None:
        # Durability is not what these tests are about: without fsync a start and a restart take far less.
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        self._as_server_user(
            postgres_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start"
        )
        self._running = True

    def stop(self, mode: str = "fast") -> None:
        """fast: every open connection is cut, as in a real restart of the server; immediate: a crash."""
        self._as_server_user(postgres_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")
        self._running = False

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

    def close(self) -> None:
        if self._running:
            try:
                self.stop("immediate")
            except subprocess.CalledProcessError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)

    def _as_server_user(self, *command: str) -> None:
        user = POSTGRES_OS_USER if os.geteuid() == 0 else None
        environment = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        result = subprocess.run(
            command, cwd=self.root, env=environment, user=user, capture_output=True, text=True, timeout=120
        )
        if result.returncode != 0:
            log = self.log.read_text()[-4000:] if self.log.exists() else ""
            raise subprocess.CalledProcessError(result.returncode, command, result.stdout, result.stderr + log)


class PrivateRedis:
    """A Redis server of the test's own on a free port that keeps nothing on disk: stopped, it forgets
    every queued message, as a Redis restarted without persistence does."""

    def __init__(self):
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="loom-private-redis-"))
        self.process: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        command = [
            shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self.root),
        ]  # fmt: skip
        with open(self.root / "redis.log", "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        wait_until(lambda: self._answers(client), START_TIMEOUT_S, f"the private Redis on port {self.port} to answer")

    def _answers(self, client: redis.Redis) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {self.process.returncode}; see {self.root / 'redis.log'}")
        try:
            return client.ping()
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class Service:
    """One long-running process of the deployment, leading a process group of its own."""

    def __init__(self, name: str, command: list[str], environment: dict[str, str], log: Path):
        self.name = name
        self.command = command
        self.environment = environment
        self.log = log
        self.process: subprocess.Popen | None = None
        self.log_offset = 0

    def start(self) -> None:
        self.log_offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                cwd=REPO_ROOT,
                env=self.environment,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def output_since_start(self) -> str:
        with open(self.log, "rb") as log:
            log.seek(self.log_offset)
            return log.read().decode(errors="replace")

    def check_alive(self) -> None:
        if not self.alive:
            raise RuntimeError(
                f"{self.name} exited with {self.process.returncode}; its log ends:\n{self.output_since_start()[-4000:]}"
            )

    def kill(self) -> None:
        """SIGKILL the service's process group: the process and what it started that did not leave the group
        (a prefork pool's children); anything that went off into a session of its own lives on."""
        if self.alive:
            signal_quietly(self.process.pid, signal.SIGKILL, group=True)
            self.process.wait()

    def stop(self) -> None:
        """SIGTERM, as `docker compose stop` sends it, then SIGKILL for what is left after STOP_GRACE_S."""
        if self.process is None:
            return
        signal_quietly(self.process.pid, signal.SIGTERM, group=True)
        try:
            self.process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        signal_quietly(self.process.pid, signal.SIGKILL, group=True)
        self.process.wait()


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict | list | None


class Deployment:
    """The platform on a private PostgreSQL and Redis: `manage.py migrate`, a user with an API token, uvicorn
    serving pages, API and ingest, a launch worker and a monitor worker that also runs Celery beat (the
    reconciler and the hang check, on their own queue)."""

    MONITOR_QUEUE = "loom-monitor"

    def __init__(self, postgres: PrivatePostgres, redis_server: PrivateRedis, host: str = "127.0.0.1", **settings: str):
        self.postgres = postgres
        self.redis = redis_server
        self.home = Path(tempfile.mkdtemp(prefix="loom-deployment-"))
        self.marker = uuid.uuid4().hex
        self.port = free_port()
        # Where the ranks reach it: a Slurm node in a namespace of its own reaches the host on the bridge's address.
        self.host = host
        self.url = f"http://{host}:{self.port}"
        self.token = ""
        self.environment = self._environment(settings)
        celery = str(VENV_BIN / "celery")
        self.web = Service(
            "web",
            [
                str(VENV_BIN / "uvicorn"), "loom.asgi:application", "--host", host, "--port", str(self.port),
                "--no-access-log", "--timeout-graceful-shutdown", "5",
            ],
            self.environment,
            self.home / "web.log",
        )  # fmt: skip
        self.worker = Service(
            "launch worker",
            [celery, "-A", "loom", "worker", "--pool", "threads", "--concurrency", "2", "-n", "launch@%h",
             "--loglevel", "INFO"],
            self.environment,
            self.home / "worker.log",
        )  # fmt: skip
        self.monitor = Service(
            "monitor worker",
            [celery, "-A", "loom", "worker", "--queues", self.MONITOR_QUEUE, "--pool", "threads", "--concurrency",
             "1", "--beat", "--schedule", str(self.home / "beat-schedule"), "-n", "monitor@%h", "--loglevel", "INFO"],
            self.environment,
            self.home / "monitor.log",
        )  # fmt: skip

    def _environment(self, overrides: dict[str, str]) -> dict[str, str]:
        inherited = {
            name: value
            for name, value in os.environ.items()
            if name not in FOREIGN_SETTINGS and not name.startswith("LOOM_")
        }
        return inherited | {
            "DATABASE_URL": self.postgres.url,
            "REDIS_URL": self.redis.url,
            "LOOM_HOME": str(self.home),
            "LOOM_RUNS_DIR": str(self.home / "runs"),
            "LOOM_URL": self.url,
            "LOOM_INGEST_URL": self.url,
            "LOOM_RECONCILE_INTERVAL_S": "1",
            "LOOM_RELAUNCH_AFTER_S": "3",
            "LOOM_MONITOR_QUEUE": self.MONITOR_QUEUE,
            "LOOM_CANCEL_GRACE_S": "5",
            "LOOM_LAUNCH_GPUS": "none",
            # A deployment has a secret key of its own (DEBUG is off: without one the platform does not start).
            "LOOM_SECRET_KEY": f"loom-test-deployment-{self.marker}",
            # The ranks get only the environment they need; the marker must reach them for processes() to find them.
            "LOOM_RANK_ENV": MARKER_VARIABLE,
            "PYTHONUNBUFFERED": "1",
            # As manage.py and pytest put them: this checkout's sources, whatever the virtualenv installed.
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "platform"), str(REPO_ROOT)]),
            MARKER_VARIABLE: self.marker,
            **overrides,
        }

    def start(self) -> "Deployment":
        try:
            self.manage("migrate", "--noinput")
            self.token = self.manage("create_api_user", "fault-tests", "--token-name", "fault-tests").strip()
            self.web.start()
            self.monitor.start()
            self.start_worker()
            wait_until(self._web_answers, START_TIMEOUT_S, f"the web server on {self.url}")
            wait_until(lambda: self._worker_ready(self.monitor), START_TIMEOUT_S, "the monitor worker to be ready")
        except BaseException:
            self.stop()
            raise
        return self

    def manage(self, *arguments: str) -> str:
        result = subprocess.run(
            [sys.executable, "manage.py", *arguments],
            cwd=REPO_ROOT,
            env=self.environment,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(arguments)} failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout

    def _web_answers(self) -> bool:
        self.web.check_alive()
        try:
            with urllib.request.urlopen(f"{self.url}/login/", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError):
            return False

    @staticmethod
    def _worker_ready(service: Service) -> bool:
        service.check_alive()
        return " ready." in service.output_since_start()

    def start_worker(self) -> None:
        """Start the launch worker (again) and wait until it takes tasks."""
        self.worker.start()
        wait_until(lambda: self._worker_ready(self.worker), START_TIMEOUT_S, "the launch worker to be ready")

    def kill_worker(self) -> None:
        """What `kill -9 <worker pid>` does to the launch worker: it vanishes mid-task without a word."""
        self.worker.kill()

    def stop(self) -> None:
        """Stop every service, then every process they left (detached torchrun sessions, their ranks)."""
        for service in (self.worker, self.monitor, self.web):
            service.stop()
        self.kill_leftovers()
        shutil.rmtree(self.home, ignore_errors=True)

    def processes(self, **environment: str) -> list[int]:
        """This deployment's running processes whose environment also holds the given variables
        (LOOM_ATTEMPT="12": every process of attempt 12: its supervisor, torchrun, the ranks)."""
        return live_processes_where(**{MARKER_VARIABLE: self.marker}, **environment)

    def attempt_processes(self) -> list[int]:
        """The supervisors, torchruns and ranks of every attempt this deployment launched that still run."""
        return [pid for pid in self.processes() if "LOOM_ATTEMPT" in environment_of(pid)]

    def end_every_run(self, timeout: float = 60.0) -> None:
        """Cancel every run still active, then SIGKILL any attempt's process the cancels left: a run one test
        left training must neither take the next test's CPU nor come back as a restart."""
        for run in self.active_runs():
            self.cancel(run["id"])
        try:
            wait_until(lambda: not self.attempt_processes(), timeout, "the cancelled attempts' processes to end")
        except AssertionError:
            for pid in self.attempt_processes():
                signal_quietly(pid, signal.SIGKILL)

    def active_runs(self) -> list[dict]:
        """Every run not yet ended, archived or not, page after page; none when the API does not answer."""
        active = []
        for archived in ("false", "true"):
            cursor = ""
            while True:
                page = f"&cursor={cursor}" if cursor else ""
                answer = self.api("GET", f"/runs?archived={archived}&limit=200{page}")
                if answer.status != 200:
                    break
                active += [
                    run for run in answer.body["runs"] if run["state"] not in ("succeeded", "failed", "cancelled")
                ]
                cursor = answer.body["next_cursor"]
                if not cursor:
                    break
        return active

    def kill_leftovers(self) -> list[str]:
        """SIGKILL whatever of this deployment still runs; returns what it found, to tell a test about it."""
        found = [f"{pid}: {command_line(pid)}" for pid in self.processes()]
        for _ in range(50):
            left = self.processes()
            if not left:
                break
            for pid in left:
                signal_quietly(pid, signal.SIGKILL)
            time.sleep(0.1)
        return found

    # The API, as a script with the user's token calls it.

    def api(self, method: str, path: str, body=None, timeout: float = 60.0) -> Answer:
        request = urllib.request.Request(
            f"{self.url}/api{path}",
            method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return Answer(response.status, json.loads(response.read() or b"null"))
        except urllib.error.HTTPError as error:
            text = error.read()
            try:
                body = json.loads(text)
            except ValueError:
                body = {"errors": {"body": text.decode(errors="replace")[:2000]}}
            return Answer(error.code, body)

    def post_run(self, config: dict, name: str = "fault test") -> Answer:
        return self.api("POST", "/runs", {"name": name, "config": config})

    def run(self, run_id: int) -> dict:
        answer = self.api("GET", f"/runs/{run_id}")
        if answer.status != 200:
            raise AssertionError(f"GET /api/runs/{run_id} answered {answer.status}: {answer.body}")
        return answer.body

    def cancel(self, run_id: int) -> Answer:
        return self.api("POST", f"/runs/{run_id}/cancel")

    # The database, read directly (not through the platform) to count what happened.

    def rows(self, sql: str, *parameters) -> list[dict]:
        with psycopg.connect(self.postgres.url, row_factory=dict_row, connect_timeout=10) as connection:
            return connection.execute(sql, parameters).fetchall()

    def log_tails(self, characters: int = 3000) -> str:
        """The end of every service's log, for a failure message."""
        tails = []
        for service in (self.web, self.worker, self.monitor):
            text = service.log.read_text(errors="replace") if service.log.exists() else ""
            tails.append(f"--- {service.name} ({service.log}) ---\n{text[-characters:]}")
        return "\n".join(tails)


@contextlib.contextmanager
def private_deployment(host: str = "127.0.0.1", **settings: str):
    """A started Deployment on a PostgreSQL and a Redis of its own, all stopped and removed on the way out."""
    with contextlib.ExitStack() as stack:
        postgres = PrivatePostgres()
        stack.callback(postgres.close)
        redis_server = PrivateRedis()
        stack.callback(redis_server.close)
        running = Deployment(postgres, redis_server, host=host, **settings).start()
        stack.callback(running.stop)
        yield running
