"""releasegate control plane settings: every knob comes from the environment.

Embedded defaults (no env set): SQLite under ./var, an embedded Celery transport that
needs no server, artifacts under ./var/artifacts, DEBUG on with a throwaway key.
"""

import os
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


def envlist(name: str, default: str = "") -> list[str]:
    return [
        item.strip() for item in os.getenv(name, default).split(",") if item.strip()
    ]


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
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ALWAYS_EAGER = envbool("CELERY_TASK_ALWAYS_EAGER", "False")
# Periodic re-verification of live artifacts, run by `celery -A controlplane beat`.
CELERY_BEAT_SCHEDULE = {
    "reverify-live-deployments": {
        "task": "controlplane.releases.reverify_live_deployments",
        "schedule": float(envint("REVERIFY_INTERVAL_S", "3600")),
    }
}

# How long a running job's worker holds it without a heartbeat (tasks.py renews it
# every third of this while a stage works). While held, a repeated task for the same
# stage steps aside; once expired (the worker died), the next promote resumes the job.
RELEASEGATE_JOB_LEASE_S = envint("RELEASEGATE_JOB_LEASE_S", "900")
if RELEASEGATE_JOB_LEASE_S < 1:
    raise ImproperlyConfigured("RELEASEGATE_JOB_LEASE_S must be at least 1")

# An agent not heard from for this long is dead (the dashboard shows it so, and a
# job it runs stuck).
AGENT_DEAD_AFTER_S = envint("AGENT_DEAD_AFTER_S", "30")
if AGENT_DEAD_AFTER_S < 1:
    raise ImproperlyConfigured("AGENT_DEAD_AFTER_S must be at least 1")

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
