"""Django settings. Embedded defaults for one machine; DATABASE_URL and REDIS_URL switch to services."""

import os
from datetime import timedelta
from ipaddress import ip_network
from pathlib import Path
from urllib.parse import unquote, urlparse

import plotly
from django.core.exceptions import ImproperlyConfigured

REPO_ROOT = Path(__file__).resolve().parents[2]
LOOM_HOME = Path(os.environ.get("LOOM_HOME", REPO_ROOT / "var"))
LOOM_HOME.mkdir(parents=True, exist_ok=True)

# Off unless asked for: only the embedded bin/up turns it on (LOOM_DEBUG=1).
DEBUG = os.environ.get("LOOM_DEBUG", "0") == "1"
SECRET_KEY = os.environ.get("LOOM_SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG:
        # Sessions, CSRF tokens and password resets are signed with it: a public default would let anyone
        # forge them, so a deployment without its own key does not start.
        raise ImproperlyConfigured(
            "LOOM_SECRET_KEY is not set: give the platform a long random secret, e.g. "
            '`python -c "import secrets; print(secrets.token_urlsafe(50))"` (or LOOM_DEBUG=1 for a local trial)'
        )
    SECRET_KEY = "loom-embedded-default-not-for-production"
ALLOWED_HOSTS = os.environ.get("LOOM_ALLOWED_HOSTS", "127.0.0.1,localhost,[::1]").split(",")
CSRF_TRUSTED_ORIGINS = [o for o in os.environ.get("LOOM_CSRF_TRUSTED_ORIGINS", "").split(",") if o]
# A deployment served over HTTPS (docker/compose.yaml), behind a proxy that terminates TLS and says so in
# X-Forwarded-Proto: cookies only over HTTPS, HSTS, and plain-HTTP pages redirected. The API and /metrics are
# exempt from the redirect: ranks, the launcher and Prometheus reach web and ingest over the deployment's own
# network, in plain HTTP.
LOOM_HTTPS = os.environ.get("LOOM_HTTPS", "0") == "1"
if LOOM_HTTPS:
    SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = True
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = True
    SECURE_REDIRECT_EXEMPT = [r"^api/", r"^metrics$"]
    SECURE_HSTS_SECONDS = 365 * 24 * 3600
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    # Entering browsers' preload lists binds the whole domain to HTTPS for years: the domain's owner decides
    # that, not a control plane's defaults, so check --deploy's reminder of it (W021) stays quiet.
    SILENCED_SYSTEM_CHECKS = ["security.W021"]

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    # Its templates and static files: /api/docs serves Swagger UI from this server, not from a CDN.
    "ninja",
    # Counts failed logins and locks out an account or an address (AXES_* below).
    "axes",
    "loom.accounts",
    "loom.runs",
    "loom.telemetry",
    "loom.planner",
    "loom.checkpoints",
    "loom.alerts",
    "loom.datasets",
    "loom.operations",
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
    # Last, as axes asks: it answers a locked-out login with 429.
    "axes.middleware.AxesMiddleware",
]

AUTHENTICATION_BACKENDS = [
    # First: refuses a locked-out account or address before any password is checked.
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
# Failed logins lock out the account (from any address) and the address (for any account) after this many,
# until the cool-off has passed; the right password is refused meanwhile.
AXES_FAILURE_LIMIT = int(os.environ.get("LOOM_LOGIN_FAILURE_LIMIT", "10"))
AXES_COOLOFF_TIME = timedelta(minutes=float(os.environ.get("LOOM_LOGIN_COOLOFF_MIN", "15")))
AXES_LOCKOUT_PARAMETERS = ["username", "ip_address"]
AXES_RESET_ON_SUCCESS = True
# Behind the TLS proxy every login comes from the proxy's address: one stranger's ten failures would lock
# everyone out. The client is the address the proxy put last in X-Forwarded-For.
AXES_CLIENT_IP_CALLABLE = "loom.accounts.client_address.client_address"

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
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 10}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = LOOM_HOME / "static"
# Files come from the finders (no collectstatic step); WhiteNoise still looks for this folder at start-up.
STATIC_ROOT.mkdir(exist_ok=True)
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
# Directories users may register prepared datasets and import Hugging Face models from (comma-separated): a
# registered path must resolve, symlinks followed, inside one of them. Where imported models are converted to and
# checkpoints exported to. Each is created when first used.
LOOM_DATA_ROOTS = [
    Path(root) for root in os.environ.get("LOOM_DATA_ROOTS", str(LOOM_HOME / "data")).split(",") if root.strip()
]
LOOM_MODELS_DIR = Path(os.environ.get("LOOM_MODELS_DIR", LOOM_HOME / "models"))
LOOM_EXPORTS_DIR = Path(os.environ.get("LOOM_EXPORTS_DIR", LOOM_HOME / "exports"))
# The GPUs the launch backend's ranks train on, comma-separated as torch names them ("NVIDIA H100 80GB
# HBM3"), or "none" for CPU; unset, the web process asks torch on its own machine (runs/hardware.py).
LOOM_LAUNCH_GPUS = os.environ.get("LOOM_LAUNCH_GPUS")
LOOM_INGEST_MAX_BYTES = 1024 * 1024
LOOM_INGEST_MAX_EVENTS = 5000
# An attempt's token still stores this long after the attempt finished: its ranks' last batches and the
# launcher's final report arrive after the end is recorded. Past it, the token is refused (401).
LOOM_INGEST_GRACE_S = float(os.environ.get("LOOM_INGEST_GRACE_S", "120"))
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
# Ranks start with an allow-listed environment (loom/runs/backends/environment.py), never the platform's secrets
# (LOOM_SECRET_KEY, DATABASE_URL, REDIS_URL); these comma-separated names are passed to them as well.
LOOM_RANK_ENV = [name for name in os.environ.get("LOOM_RANK_ENV", "").split(",") if name]
# How many attempts the local backend runs at once on this host; the next wait queued until one ends (a
# cluster's scheduler does this for the slurm backend).
LOOM_LOCAL_MAX_ATTEMPTS = int(os.environ.get("LOOM_LOCAL_MAX_ATTEMPTS", "4"))
# How many ranks a node runs (its GPUs; on CPU, as many as it has cores to spare): a layout of world size W
# asks the backend for ceil(W / LOOM_RANKS_PER_NODE) nodes. The local backend runs every rank on one host.
LOOM_RANKS_PER_NODE = int(os.environ.get("LOOM_RANKS_PER_NODE", "8"))
# Limits a new run is held to (loom/runs/limits.py). CPU rank slots: how many ranks the local backend runs on
# this host when its ranks train on CPU (gloo ranks of a small model share cores well; a GPU host has one rank
# per GPU). Model size: parameters, as the planner counts them. Per user: ranks held by their active runs, and
# runs waiting queued.
LOOM_LOCAL_CPU_SLOTS = int(os.environ.get("LOOM_LOCAL_CPU_SLOTS", str(4 * (os.cpu_count() or 1))))
LOOM_MAX_MODEL_PARAMETERS = int(float(os.environ.get("LOOM_MAX_MODEL_PARAMETERS", "1e12")))
LOOM_USER_MAX_RANKS = int(os.environ.get("LOOM_USER_MAX_RANKS", "1024"))
LOOM_USER_MAX_QUEUED = int(os.environ.get("LOOM_USER_MAX_QUEUED", "32"))
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
# Webhooks go only to public addresses (alerts/webhooks.py); these comma-separated networks (CIDRs) and
# host names are allowed besides, for receivers inside the deployment's own network.
LOOM_WEBHOOK_ALLOWED_NETWORKS = [
    entry.strip() for entry in os.environ.get("LOOM_WEBHOOK_ALLOWED_NETWORKS", "").split(",") if entry.strip()
]
CELERY_TASK_ROUTES = (
    {
        task: {"queue": LOOM_MONITOR_QUEUE}
        for task in ("loom.alerts.check_hangs", "loom.runs.reconcile", "loom.runs.cancel_attempt")
    }
    if LOOM_MONITOR_QUEUE
    else {}
)


def metrics_networks(value: str) -> list:
    try:
        return [ip_network(entry.strip()) for entry in value.split(",") if entry.strip()]
    except ValueError as error:
        raise ImproperlyConfigured(
            f"LOOM_METRICS_NETWORKS: {error}; give networks as CIDRs, e.g. 10.0.0.0/8,fd00::/8"
        ) from None


# GET /metrics (loom/operations) answers a scraper that sends `Authorization: Bearer <LOOM_METRICS_TOKEN>`
# (unset: no token opens it) or whose address (accounts/client_address.py) is inside one of these
# comma-separated networks (default: this host only).
LOOM_METRICS_TOKEN = os.environ.get("LOOM_METRICS_TOKEN", "")
LOOM_METRICS_NETWORKS = metrics_networks(os.environ.get("LOOM_METRICS_NETWORKS", "127.0.0.0/8,::1/128"))

# text: each record's message alone, as a developer's console reads best; json: one object a line (time,
# level, logger, message, and the run and attempt it was logged for) from every process, for a log pipeline.
LOOM_LOG_FORMAT = os.environ.get("LOOM_LOG_FORMAT", "text")
if LOOM_LOG_FORMAT not in ("text", "json"):
    raise ImproperlyConfigured(f"LOOM_LOG_FORMAT must be text or json, not {LOOM_LOG_FORMAT!r}")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"run_context": {"()": "loom.operations.structured_logs.RunContextFilter"}},
    "formatters": {"json": {"()": "loom.operations.structured_logs.JsonFormatter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "filters": ["run_context"]}},
    "loggers": {
        "loom": {"handlers": ["console"], "level": "INFO"},
        # A failed request's traceback reaches stderr with DEBUG off too (Django's own console is DEBUG-only).
        "django.request": {"handlers": ["console"], "level": "ERROR", "propagate": False},
    },
}
if LOOM_LOG_FORMAT == "json":
    # Every library's records too, each once, through the one JSON handler at the root: loom's, Django's
    # (without its DEBUG-only console), uvicorn's (configured before this, so taken over here). Celery sets up
    # its worker's own handlers after this and turns them to JSON (loom/celery.py).
    LOGGING["handlers"]["console"]["formatter"] = "json"
    LOGGING["root"] = {"handlers": ["console"], "level": "INFO"}
    LOGGING["loggers"] = {
        "loom": {"level": "INFO"},
        "django": {"level": "INFO"},
        "django.request": {"level": "ERROR"},
        "uvicorn": {"level": "INFO", "propagate": True},
        "uvicorn.access": {"level": "INFO", "propagate": True},
    }
