"""releasegate control plane settings: every knob comes from the environment.

Embedded defaults (no env set): SQLite under ./var, an embedded Celery transport that
needs no server, artifacts under ./var/artifacts, DEBUG on with a throwaway key.
"""

import os
import ssl
import tempfile
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent


def envbool(name: str, default: str = "False") -> bool:
    value = os.getenv(name, default).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean, got {value!r}")


def envint(name: str, default: str) -> int:
    value = os.getenv(name, default)
    try:
        return int(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be an integer, got {value!r}") from exc


def envfloat(name: str, default: str) -> float:
    value = os.getenv(name, default)
    try:
        return float(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be a number, got {value!r}") from exc


def envlist(name: str, default: str = "") -> list[str]:
    return [
        item.strip() for item in os.getenv(name, default).split(",") if item.strip()
    ]


def broker_transport_options(
    url: str, *, connect_timeout_s: float, socket_timeout_s: float
) -> dict:
    """Short timeouts, and no reconnect loop of kombu's own, for a Redis broker.
    (The embedded SQLAlchemy transport hands these to create_engine, which refuses
    them; it has no network to wait on.)"""
    if not url.startswith(("redis://", "rediss://", "redis+socket://")):
        return {}
    return {
        "max_retries": 0,
        "socket_connect_timeout": connect_timeout_s,
        "socket_timeout": socket_timeout_s,
    }


def redis_tls_options(url: str) -> dict | bool:
    """For a rediss:// URL, TLS that checks the server's certificate against the
    system's CAs: kombu's own default for rediss:// without options is CERT_NONE
    (encrypted, to anyone). ssl_* parameters in the URL (ssl_ca_certs=/path,
    ssl_certfile=, ssl_keyfile=) replace these whole. False for other URLs."""
    if not url.startswith("rediss://"):
        return False
    return {"ssl_cert_reqs": ssl.CERT_REQUIRED}


DATA_DIR = Path(os.getenv("RELEASEGATE_DATA_DIR", BASE_DIR / "var"))
if not (os.getenv("DATABASE_URL") and os.getenv("CELERY_BROKER_URL")):
    # The embedded defaults keep their SQLite files here; SQLite won't create folders.
    DATA_DIR.mkdir(parents=True, exist_ok=True)
DEBUG = envbool("DEBUG", "True")

SECRET_KEY = os.getenv("SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY is required when DEBUG is off")
    SECRET_KEY = "insecure-development-key-only-for-debug-mode"

ALLOWED_HOSTS = envlist("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]" if DEBUG else "")
CSRF_TRUSTED_ORIGINS = envlist("CSRF_TRUSTED_ORIGINS")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "ninja",  # serves the API docs' assets locally (no CDN)
    "controlplane.accounts",
    "controlplane.fleet",
    "controlplane.releases",
    "controlplane.audit",
    "controlplane.dispatch",
    "controlplane.webhooks",
    "controlplane.costs",
    "controlplane.loadplans",
    "controlplane.dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
WSGI_APPLICATION = "controlplane.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
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

DATABASES = {
    "default": dj_database_url.parse(
        os.getenv("DATABASE_URL", f"sqlite:///{DATA_DIR / 'releasegate.sqlite3'}"),
        conn_max_age=envint("DB_CONN_MAX_AGE", "0"),
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The embedded default has a web server and a worker writing one file: WAL lets
    # readers run beside the writer, IMMEDIATE takes the write lock when a transaction
    # starts (so select_for_update's no-op on SQLite still serializes transitions),
    # and a long timeout waits for the lock instead of failing.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            "timeout": envint("SQLITE_TIMEOUT_S", "30"),
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL",
        }
    )
    # Tests use a file, not ":memory:", so a real worker process can open the test
    # database; one file per test process so concurrent test runs don't collide.
    DATABASES["default"]["TEST"] = {
        "NAME": os.getenv(
            "SQLITE_TEST_NAME",
            str(
                Path(tempfile.gettempdir()) / f"releasegate-test-{os.getpid()}.sqlite3"
            ),
        )
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_FINDERS = [
    "django.contrib.staticfiles.finders.FileSystemFinder",
    "django.contrib.staticfiles.finders.AppDirectoriesFinder",
    # plotly.js for the dashboard's charts, from the installed plotly package
    "controlplane.dashboard.staticfiles.PlotlyFinder",
]
STATIC_ROOT = Path(os.getenv("STATIC_ROOT", DATA_DIR / "static"))
ARTIFACT_ROOT = Path(os.getenv("ARTIFACT_ROOT", DATA_DIR / "artifacts"))
# The folders on this host that release sources may come from (comma-separated,
# absolute). Each team is confined to its own folders inside them: Team.source_roots
# when an operator set it (admin), else <root>/<team slug> for each root here.
RELEASEGATE_SOURCE_ROOTS = [
    Path(p) for p in envlist("RELEASEGATE_SOURCE_ROOTS", str(DATA_DIR / "sources"))
]
if not all(p.is_absolute() for p in RELEASEGATE_SOURCE_ROOTS):
    raise ImproperlyConfigured("RELEASEGATE_SOURCE_ROOTS must be absolute paths")

LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

# Celery: embedded transport by default (no server); Redis in production and CI.
CELERY_BROKER_URL = os.getenv(
    "CELERY_BROKER_URL", f"sqla+sqlite:///{DATA_DIR / 'celery-broker.sqlite3'}"
)
CELERY_RESULT_BACKEND = os.getenv(
    "CELERY_RESULT_BACKEND", f"db+sqlite:///{DATA_DIR / 'celery-results.sqlite3'}"
)
# The queue tasks go to unless sent elsewhere (beat's too); a worker consumes it.
CELERY_TASK_DEFAULT_QUEUE = os.getenv("CELERY_TASK_DEFAULT_QUEUE", "celery")
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ALWAYS_EAGER = envbool("CELERY_TASK_ALWAYS_EAGER", "False")
# A broker that is down must cost a request little: connect and socket timeouts are
# short and kombu does not retry connecting on its own (its default backoff made a
# promote wait ~19 s). Writes queue tasks through the outbox (controlplane.dispatch),
# which retries; a worker's own .delay() calls retry per the publish policy.
BROKER_CONNECT_TIMEOUT_S = envfloat("BROKER_CONNECT_TIMEOUT_S", "1")
CELERY_BROKER_CONNECTION_TIMEOUT = BROKER_CONNECT_TIMEOUT_S
CELERY_BROKER_TRANSPORT_OPTIONS = broker_transport_options(
    CELERY_BROKER_URL,
    connect_timeout_s=BROKER_CONNECT_TIMEOUT_S,
    socket_timeout_s=envfloat("BROKER_SOCKET_TIMEOUT_S", "5"),
)
CELERY_TASK_PUBLISH_RETRY_POLICY = {
    "max_retries": 2,
    "interval_start": 0,
    "interval_step": 0.5,
    "interval_max": 1,
}
# rediss://: TLS with the server's certificate checked (the deploy checks in
# controlplane/dispatch/checks.py warn about plain redis:// and a missing ACL user).
CELERY_BROKER_USE_SSL = redis_tls_options(CELERY_BROKER_URL)
CELERY_REDIS_BACKEND_USE_SSL = redis_tls_options(CELERY_RESULT_BACKEND) or None
CELERY_REDIS_SOCKET_CONNECT_TIMEOUT = BROKER_CONNECT_TIMEOUT_S
CELERY_REDIS_SOCKET_TIMEOUT = envfloat("BROKER_SOCKET_TIMEOUT_S", "5")
# Nothing reads a task's result (what a task does is in the database), so none is
# stored and no publish subscribes to one: before a send, the Redis result backend
# subscribed to the task's result channel and, with the store down, retried that 20
# times 1 s apart, so a promote answered after ~19 s. Anything that does touch the
# store anyway fails after one try of BROKER_CONNECT_TIMEOUT_S.
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = {"retry_policy": {"max_retries": 0}}
CELERY_RESULT_BACKEND_ALWAYS_RETRY = False
# The outbox: a committed write publishes its tasks at once unless this is off (then
# only the relay does); the relay runs every RELEASEGATE_OUTBOX_RELAY_S on beat and
# backs off a failing message up to RELEASEGATE_OUTBOX_MAX_DELAY_S.
RELEASEGATE_OUTBOX_PUBLISH_ON_COMMIT = envbool(
    "RELEASEGATE_OUTBOX_PUBLISH_ON_COMMIT", "True"
)
RELEASEGATE_OUTBOX_PUBLISH_TIMEOUT_S = envfloat(
    "RELEASEGATE_OUTBOX_PUBLISH_TIMEOUT_S", "1"
)
RELEASEGATE_OUTBOX_RELAY_S = envfloat("RELEASEGATE_OUTBOX_RELAY_S", "10")
RELEASEGATE_OUTBOX_MAX_DELAY_S = envfloat("RELEASEGATE_OUTBOX_MAX_DELAY_S", "60")
# Periodic jobs, run by `celery -A controlplane beat`: re-verification of live
# artifacts, and the outbox relay.
CELERY_BEAT_SCHEDULE = {
    "reverify-live-deployments": {
        "task": "controlplane.releases.reverify_live_deployments",
        "schedule": float(envint("REVERIFY_INTERVAL_S", "3600")),
    },
    "relay-outbox": {
        "task": "controlplane.dispatch.relay_outbox",
        "schedule": RELEASEGATE_OUTBOX_RELAY_S,
    },
}

# Agents (gpuagent): jobs go to the pool's queue unless one agent must do them;
# an agent silent for AGENT_DEAD_AFTER_S (below) is offline and its job is sent
# again (up to RELEASEGATE_JOB_MAX_ATTEMPTS, then the release fails with why); a job
# no agent took within RELEASEGATE_JOB_QUEUE_TIMEOUT_S, or without a result
# RELEASEGATE_JOB_TIME_LIMIT_S after it started, likewise. The watch runs every
# RELEASEGATE_AGENT_CHECK_S on beat.
RELEASEGATE_AGENT_POOL_QUEUE = os.getenv("RELEASEGATE_AGENT_POOL_QUEUE", "agents")
RELEASEGATE_AGENT_CHECK_S = envfloat("RELEASEGATE_AGENT_CHECK_S", "10")
RELEASEGATE_JOB_MAX_ATTEMPTS = envint("RELEASEGATE_JOB_MAX_ATTEMPTS", "3")
# A rollback whose target no longer verifies on the agent tries the next older
# release, up to this many releases in all, then ends with the reasons.
RELEASEGATE_ROLLBACK_MAX_CANDIDATES = envint("RELEASEGATE_ROLLBACK_MAX_CANDIDATES", "3")
RELEASEGATE_JOB_QUEUE_TIMEOUT_S = envfloat("RELEASEGATE_JOB_QUEUE_TIMEOUT_S", "900")
RELEASEGATE_JOB_TIME_LIMIT_S = envfloat("RELEASEGATE_JOB_TIME_LIMIT_S", "900")
# Audit events are chained as their transactions commit; the beat chains any whose
# chaining was lost (the process killed right after the commit) every
# RELEASEGATE_AUDIT_CHAIN_S.
RELEASEGATE_AUDIT_CHAIN_S = envfloat("RELEASEGATE_AUDIT_CHAIN_S", "30")
CELERY_BEAT_SCHEDULE["chain-audit-events"] = {
    "task": "controlplane.audit.chain_pending",
    "schedule": RELEASEGATE_AUDIT_CHAIN_S,
}
CELERY_BEAT_SCHEDULE["close-audit-windows"] = {
    "task": "controlplane.audit.close_event_windows",
    "schedule": RELEASEGATE_AUDIT_CHAIN_S,
}
CELERY_BEAT_SCHEDULE["watch-agent-jobs"] = {
    "task": "controlplane.releases.watch_jobs",
    "schedule": RELEASEGATE_AGENT_CHECK_S,
}

# Agent identity (controlplane.fleet.enrollment, gpuagent.identity): the control
# plane seals job requests with its Ed25519 key at RELEASEGATE_CONTROLPLANE_KEY
# (created there on first use: set the path in production, never commit the key;
# agents are given its public half). Agent messages are believed only when sealed
# by an enrolled agent within RELEASEGATE_MESSAGE_MAX_SKEW_S of now; at most
# RELEASEGATE_MAX_PENDING_ENROLLMENTS unknown keys wait for an operator at once.
# RELEASEGATE_ALLOW_VERIFY_ON_SIGNER lets the signer's own identity verify (the
# one-agent demo only: it defeats the second look).
RELEASEGATE_CONTROLPLANE_KEY = Path(
    os.getenv("RELEASEGATE_CONTROLPLANE_KEY", DATA_DIR / "keys" / "controlplane.key")
)
RELEASEGATE_MESSAGE_MAX_SKEW_S = envfloat("RELEASEGATE_MESSAGE_MAX_SKEW_S", "300")
RELEASEGATE_MAX_PENDING_ENROLLMENTS = envint(
    "RELEASEGATE_MAX_PENDING_ENROLLMENTS", "100"
)
RELEASEGATE_ALLOW_VERIFY_ON_SIGNER = envbool("RELEASEGATE_ALLOW_VERIFY_ON_SIGNER")
# Refused messages are audited bounded (a flood of forged ones must not grow the
# log without end): per source (an enrolled agent, else all unenrolled senders
# together) and kind of reason, the first in each window in full, the rest as one
# counted event when the window has passed; at most so many reasons per source
# and window, the rest counted together.
RELEASEGATE_REFUSAL_WINDOW_S = envfloat("RELEASEGATE_REFUSAL_WINDOW_S", "60")
RELEASEGATE_REFUSAL_REASONS_PER_WINDOW = envint(
    "RELEASEGATE_REFUSAL_REASONS_PER_WINDOW", "20"
)

# How long a control-plane job (the gate) holds its row while it runs: while held, a
# repeated task for the same stage steps aside.
RELEASEGATE_JOB_LEASE_S = envint("RELEASEGATE_JOB_LEASE_S", "900")
if RELEASEGATE_JOB_LEASE_S < 1:
    raise ImproperlyConfigured("RELEASEGATE_JOB_LEASE_S must be at least 1")

# An agent not heard from for this long is dead (the dashboard shows it so, and a
# job it runs stuck).
AGENT_DEAD_AFTER_S = envint("AGENT_DEAD_AFTER_S", "30")
if AGENT_DEAD_AFTER_S < 1:
    raise ImproperlyConfigured("AGENT_DEAD_AFTER_S must be at least 1")

# Webhooks: secrets are encrypted with a key derived from this (SECRET_KEY unless
# set; changing it makes existing webhook secrets unreadable). Deliveries time out
# after RELEASEGATE_WEBHOOK_TIMEOUT_S and are tried up to MAX_ATTEMPTS times, waiting
# RETRY_BASE_S x 4^(n-1) (at most MAX_DELAY_S) in between. Private and loopback
# addresses are refused unless allowed (allowed by default only with DEBUG on).
RELEASEGATE_WEBHOOK_KEY = os.getenv("RELEASEGATE_WEBHOOK_KEY", SECRET_KEY)
RELEASEGATE_WEBHOOK_TIMEOUT_S = envfloat("RELEASEGATE_WEBHOOK_TIMEOUT_S", "5")
RELEASEGATE_WEBHOOK_MAX_ATTEMPTS = envint("RELEASEGATE_WEBHOOK_MAX_ATTEMPTS", "6")
RELEASEGATE_WEBHOOK_RETRY_BASE_S = envfloat("RELEASEGATE_WEBHOOK_RETRY_BASE_S", "2")
RELEASEGATE_WEBHOOK_MAX_DELAY_S = envfloat("RELEASEGATE_WEBHOOK_MAX_DELAY_S", "600")
RELEASEGATE_WEBHOOK_ALLOW_PRIVATE = envbool(
    "RELEASEGATE_WEBHOOK_ALLOW_PRIVATE", str(DEBUG)
)

# Production hardening; active whenever DEBUG is off.
SESSION_COOKIE_SECURE = not DEBUG
CSRF_COOKIE_SECURE = not DEBUG
SECURE_SSL_REDIRECT = envbool("SECURE_SSL_REDIRECT", str(not DEBUG))
SECURE_HSTS_SECONDS = envint("SECURE_HSTS_SECONDS", "0" if DEBUG else "31536000")
SECURE_HSTS_INCLUDE_SUBDOMAINS = not DEBUG
SECURE_HSTS_PRELOAD = envbool("SECURE_HSTS_PRELOAD", "False")
SECURE_PROXY_SSL_HEADER = (
    ("HTTP_X_FORWARDED_PROTO", "https")
    if envbool("BEHIND_TLS_PROXY", "False")
    else None
)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": os.getenv("LOG_LEVEL", "INFO")},
}
