"""Django settings. Embedded defaults for one machine; DATABASE_URL and REDIS_URL switch to services."""

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

import plotly

REPO_ROOT = Path(__file__).resolve().parents[2]
LOOM_HOME = Path(os.environ.get("LOOM_HOME", REPO_ROOT / "var"))
LOOM_HOME.mkdir(parents=True, exist_ok=True)

SECRET_KEY = os.environ.get("LOOM_SECRET_KEY", "loom-embedded-default-not-for-production")
DEBUG = os.environ.get("LOOM_DEBUG", "1") == "1"
ALLOWED_HOSTS = os.environ.get("LOOM_ALLOWED_HOSTS", "127.0.0.1,localhost,[::1]").split(",")
CSRF_TRUSTED_ORIGINS = [o for o in os.environ.get("LOOM_CSRF_TRUSTED_ORIGINS", "").split(",") if o]

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    # Its templates and static files: /api/docs serves Swagger UI from this server, not from a CDN.
    "ninja",
    "loom.accounts",
    "loom.runs",
    "loom.telemetry",
    "loom.planner",
    "loom.checkpoints",
    "loom.alerts",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "loom.urls"
ASGI_APPLICATION = "loom.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [REPO_ROOT / "frontend" / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


def database_from_url(url: str) -> dict:
    """postgresql://user:password@host:port/name → Django's DATABASES entry (psycopg 3)."""
    parts = urlparse(url)
    if parts.scheme not in ("postgres", "postgresql"):
        raise ValueError(f"DATABASE_URL must be postgresql://…, got scheme {parts.scheme!r}")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
        "CONN_MAX_AGE": 0,
    }


if os.environ.get("DATABASE_URL"):
    DATABASES = {"default": database_from_url(os.environ["DATABASE_URL"])}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": LOOM_HOME / "loom.sqlite3",
            # Web, worker and ranks' ingest write concurrently: take the write lock up front
            # and wait for it rather than failing with "database is locked".
            "OPTIONS": {"timeout": 30, "transaction_mode": "IMMEDIATE", "init_command": "PRAGMA journal_mode=WAL;"},
            # Per process, so two test sessions on one machine never share a test database.
            "TEST": {"NAME": LOOM_HOME / f"test-loom-{os.getpid()}.sqlite3"},
        }
    }

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
AUTH_PASSWORD_VALIDATORS = []
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = LOOM_HOME / "static"
STATICFILES_DIRS = [
    REPO_ROOT / "frontend" / "static",
    # Plotly.js is served from the plotly package's own bundle: no Node build step.
    ("plotly", Path(plotly.__file__).parent / "package_data"),
]
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG

REDIS_URL = os.environ.get("REDIS_URL", "")
# channels_redis waits for a consumer's next message with a blocking BZPOPMIN of 5 s; redis-py 8 gives every
# read a 5 s socket timeout by default, which tears an idle consumer (a run page's socket) down every 5 s.
# Reads wait longer than the blocking pop, and a dead Redis is still noticed.
CHANNEL_LAYER_READ_TIMEOUT_S = 30
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "loom.channel_layer.RedisChannelLayer",
            "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": CHANNEL_LAYER_READ_TIMEOUT_S}]},
        }
    }
    CELERY_BROKER_URL = REDIS_URL
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    CELERY_BROKER_URL = "filesystem://"
    (LOOM_HOME / "broker").mkdir(exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(LOOM_HOME / "broker"),
        "data_folder_out": str(LOOM_HOME / "broker"),
        "processed_folder": str(LOOM_HOME / "broker-processed"),
        "control_folder": str(LOOM_HOME / "broker-control"),
        "store_processed": False,
    }

# A launch task runs for as long as training does (hours). It is acknowledged on receipt, so
# Redis never re-delivers it when its visibility timeout runs out; launching is idempotent by
# database state anyway (see loom.runs.launcher.claim_attempt).
CELERY_TASK_ACKS_LATE = False
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

# This platform's own address.
LOOM_URL = os.environ.get("LOOM_URL", "http://127.0.0.1:8000")
# Where the launcher tells ranks (and itself) to send telemetry: a web process that serves only ingest
# (docker/compose.yaml's `ingest`), so a 1,024-rank run's batches never queue behind pages' chart
# requests; by default this platform's own ingest API. Apart, it needs REDIS_URL: the pages hear the
# stored events through the channel layer.
LOOM_INGEST_URL = os.environ.get("LOOM_INGEST_URL", LOOM_URL)
LOOM_RUNS_DIR = Path(os.environ.get("LOOM_RUNS_DIR", LOOM_HOME / "runs"))
# The GPUs the launch backend's ranks train on, comma-separated as torch names them ("NVIDIA H100 80GB
# HBM3"), or "none" for CPU; unset, the web process asks torch on its own machine (runs/hardware.py).
LOOM_LAUNCH_GPUS = os.environ.get("LOOM_LAUNCH_GPUS")
LOOM_INGEST_MAX_BYTES = 1024 * 1024
LOOM_INGEST_MAX_EVENTS = 5000
LOOM_CANCEL_GRACE_S = float(os.environ.get("LOOM_CANCEL_GRACE_S", "10"))
# A run's pages get at most one websocket message per this interval from each web process.
LOOM_FANOUT_INTERVAL_S = float(os.environ.get("LOOM_FANOUT_INTERVAL_S", "0.1"))
# How often a web process judges each attempt that reported metrics (loom/alerts/watch.py).
LOOM_ALERTS_INTERVAL_S = float(os.environ.get("LOOM_ALERTS_INTERVAL_S", "1.0"))
# Every open page also asks this often for alerts it may have missed (a dropped websocket message).
LOOM_ALERTS_RESYNC_S = float(os.environ.get("LOOM_ALERTS_RESYNC_S", "30"))
# How often Celery beat has running attempts checked for hangs (loom/alerts/hangs.py), and the queue that
# check goes to. A worker's every slot can be busy supervising runs for days, so a deployment gives the check
# a queue and a small worker of its own (bin/up, docker/compose.yaml); unset, it shares the default queue.
LOOM_HANG_CHECK_INTERVAL_S = float(os.environ.get("LOOM_HANG_CHECK_INTERVAL_S", "10"))
LOOM_MONITOR_QUEUE = os.environ.get("LOOM_MONITOR_QUEUE", "")
# Where attempts run (loom/runs/backends): "local", torchrun on the worker's host, or "slurm", the cluster's
# scheduler. LOOM_RUNS_DIR then has to be a directory every node mounts at the same path.
LOOM_BACKEND = os.environ.get("LOOM_BACKEND", "local")
LOOM_BACKENDS = {
    "local": "loom.runs.backends.local.LocalBackend",
    "slurm": "loom.runs.backends.slurm.SlurmBackend",
}
# How many attempts the local backend runs at once on this host; the next wait queued until one ends (a
# cluster's scheduler does this for the slurm backend).
LOOM_LOCAL_MAX_ATTEMPTS = int(os.environ.get("LOOM_LOCAL_MAX_ATTEMPTS", "4"))
# How many ranks a node runs (its GPUs; on CPU, as many as it has cores to spare): a layout of world size W
# asks the backend for ceil(W / LOOM_RANKS_PER_NODE) nodes. The local backend runs every rank on one host.
LOOM_RANKS_PER_NODE = int(os.environ.get("LOOM_RANKS_PER_NODE", "8"))
# Slurm: the partition and account jobs are charged to (empty: the cluster's defaults), and the slurm.conf
# the client commands read (empty: theirs, /etc/slurm/slurm.conf).
LOOM_SLURM_PARTITION = os.environ.get("LOOM_SLURM_PARTITION", "")
LOOM_SLURM_ACCOUNT = os.environ.get("LOOM_SLURM_ACCOUNT", "")
LOOM_SLURM_CONF = os.environ.get("LOOM_SLURM_CONF", "")
# How often Celery beat compares every active attempt with its backend (loom/runs/reconciler.py), and how
# long a queued attempt may wait for a worker before its launch message is sent again.
LOOM_RECONCILE_INTERVAL_S = float(os.environ.get("LOOM_RECONCILE_INTERVAL_S", "5"))
LOOM_RELAUNCH_AFTER_S = float(os.environ.get("LOOM_RELAUNCH_AFTER_S", "30"))
CELERY_BEAT_SCHEDULE = {
    "check-hangs": {"task": "loom.alerts.check_hangs", "schedule": LOOM_HANG_CHECK_INTERVAL_S},
    "reconcile": {"task": "loom.runs.reconcile", "schedule": LOOM_RECONCILE_INTERVAL_S},
}
# Webhook POSTs of alert changes: tries in all, and the wait before the second (doubling after).
LOOM_WEBHOOK_TRIES = int(os.environ.get("LOOM_WEBHOOK_TRIES", "5"))
LOOM_WEBHOOK_RETRY_BASE_S = float(os.environ.get("LOOM_WEBHOOK_RETRY_BASE_S", "5"))
CELERY_TASK_ROUTES = (
    {
        task: {"queue": LOOM_MONITOR_QUEUE}
        for task in ("loom.alerts.check_hangs", "loom.runs.reconcile", "loom.runs.cancel_attempt")
    }
    if LOOM_MONITOR_QUEUE
    else {}
)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"loom": {"handlers": ["console"], "level": "INFO"}},
}
