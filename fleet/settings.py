"""Settings for the fleet personalization manager, read only from the environment.

``FLEET_ENV`` picks the profile: ``development`` (the default, used by the launcher and the tests) or
``production`` (what the compose stack runs). Production refuses to start without a real ``SECRET_KEY``,
with ``DEBUG`` on, or without ``ALLOWED_HOSTS``; ``manage.py check --deploy`` is clean with it.
"""

from __future__ import annotations

import os
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured
from kombu import Queue

from core.env import (
    database_from_url,
    env_bool,
    env_int,
    env_list,
    env_secret,
    env_str,
    redis_url,
)

BASE_DIR = Path(__file__).resolve().parent.parent

FLEET_ENV = env_str("FLEET_ENV", "development", choices=("development", "production"))
PRODUCTION = FLEET_ENV == "production"

# Only used when FLEET_ENV=development and no SECRET_KEY is given; production refuses it.
_DEVELOPMENT_SECRET_KEY = "development-only-insecure-key-never-use-in-production-0123456789"  # noqa: S105

SECRET_KEY = env_secret("SECRET_KEY") or ("" if PRODUCTION else _DEVELOPMENT_SECRET_KEY)
if PRODUCTION:
    if not SECRET_KEY:
        raise ImproperlyConfigured("SECRET_KEY (or SECRET_KEY_FILE) must be set when FLEET_ENV=production")
    if SECRET_KEY == _DEVELOPMENT_SECRET_KEY:
        raise ImproperlyConfigured("SECRET_KEY is the development default; set a real secret for production")
    if len(SECRET_KEY) < 50 or len(set(SECRET_KEY)) < 5:
        raise ImproperlyConfigured("SECRET_KEY is too weak for production: use at least 50 random characters")

DEBUG = env_bool("DEBUG", not PRODUCTION)
if PRODUCTION and DEBUG:
    raise ImproperlyConfigured("DEBUG=true is refused when FLEET_ENV=production")

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", [] if PRODUCTION else ["localhost", "127.0.0.1", "[::1]", "testserver"])
if PRODUCTION and not ALLOWED_HOSTS:
    raise ImproperlyConfigured("ALLOWED_HOSTS must list the host names the server answers to in production")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

DATA_DIR = Path(env_str("FLEET_DATA_DIR", str(BASE_DIR / ".data"))).resolve()

# --- services ---------------------------------------------------------------------------------------------

_database_url = env_secret("DATABASE_URL")
if not _database_url:
    raise ImproperlyConfigured(
        "DATABASE_URL is not set. Start through the launcher (`make run`, or "
        "`python -m fleet.launcher exec -- <command>`), which provides an embedded PostgreSQL, "
        "or point it at a server: DATABASE_URL=postgresql://user:password@host:5432/fleet"
    )
DATABASES = {"default": database_from_url("DATABASE_URL", _database_url)}
# Under ASGI every HTTP request runs its sync code in a thread of its own, so persistent connections pile up
# (one per request, until the garbage collector finds it) and a few hundred requests take every connection
# PostgreSQL allows. Django's advice for ASGI is a pool: fleet/asgi.py sets DATABASE_POOL_SIZE for the
# server processes; Celery workers and commands keep one persistent connection per process.
DATABASE_POOL_SIZE = env_int("DATABASE_POOL_SIZE", 0, minimum=0, maximum=200)
if DATABASE_POOL_SIZE:
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    DATABASES["default"]["OPTIONS"]["pool"] = {
        "min_size": min(2, DATABASE_POOL_SIZE),
        "max_size": DATABASE_POOL_SIZE,
        "timeout": env_int("DATABASE_POOL_TIMEOUT", 30, minimum=1),
    }
else:
    DATABASES["default"]["CONN_MAX_AGE"] = env_int("DATABASE_CONN_MAX_AGE", 60, minimum=0)
# With a pool, Django has the pool check each connection as it hands it out (after a PostgreSQL restart).
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True

_redis_url = env_secret("REDIS_URL")
if not _redis_url:
    raise ImproperlyConfigured(
        "REDIS_URL is not set. Start through the launcher (`make run`), which provides an embedded Redis, "
        "or point it at a server: REDIS_URL=redis://host:6379/0"
    )
REDIS_URL = redis_url("REDIS_URL", _redis_url)
# Namespaces every key this deployment writes to Redis (cache, channel layer, Celery control), so two
# deployments or a test run can share one Redis server without seeing each other.
REDIS_PREFIX = env_str("REDIS_PREFIX", "fleet")

CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": REDIS_PREFIX,
    }
}

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {
            "hosts": [REDIS_URL],
            "prefix": f"{REDIS_PREFIX}:asgi",
            "capacity": env_int("CHANNEL_LAYER_CAPACITY", 1000, minimum=10),
            "expiry": 60,
        },
    }
}

# --- Celery (read by fleet/celery.py through the CELERY_ namespace) ----------------------------------------

CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = REDIS_URL
CELERY_RESULT_EXPIRES = 24 * 3600
CELERY_TASK_DEFAULT_QUEUE = env_str("CELERY_QUEUE", "fleet")
# Aggregation has a queue of its own, so a closed round is never stuck behind a backlog of verifications.
# Every worker consumes both unless started with -Q (the compose stack can run dedicated aggregators).
CELERY_AGGREGATION_QUEUE = f"{CELERY_TASK_DEFAULT_QUEUE}.aggregation"
CELERY_TASK_QUEUES = (Queue(CELERY_TASK_DEFAULT_QUEUE), Queue(CELERY_AGGREGATION_QUEUE))
CELERY_TASK_ROUTES = {
    "training.tasks.aggregate_round": {"queue": CELERY_AGGREGATION_QUEUE},
    "training.tasks.aggregate_shard": {"queue": CELERY_AGGREGATION_QUEUE},
    "training.tasks.combine_shards": {"queue": CELERY_AGGREGATION_QUEUE},
    "training.tasks.aggregate_span": {"queue": CELERY_AGGREGATION_QUEUE},
    "training.tasks.combine_spans": {"queue": CELERY_AGGREGATION_QUEUE},
}
CELERY_CONTROL_EXCHANGE = f"{REDIS_PREFIX}.control"
CELERY_EVENT_EXCHANGE = f"{REDIS_PREFIX}.events"
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_TIME_LIMIT = env_int("CELERY_TASK_TIME_LIMIT", 900, minimum=10)
CELERY_TASK_SOFT_TIME_LIMIT = CELERY_TASK_TIME_LIMIT - 30 if CELERY_TASK_TIME_LIMIT > 60 else CELERY_TASK_TIME_LIMIT
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A task not acknowledged within this time is handed to another worker; longer than the task time limit.
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": CELERY_TASK_TIME_LIMIT * 2,
    "global_keyprefix": f"{REDIS_PREFIX}:",
}
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BEAT_SCHEDULE = {
    "beat-tick": {"task": "fleet.tasks.beat_tick", "schedule": 15.0, "options": {"expires": 14}},
    "purge-expired-api-tokens": {"task": "accounts.tasks.purge_expired_api_tokens", "schedule": 3600.0},
}

# --- Django ---------------------------------------------------------------------------------------------

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "accounts",
    "devices",
    "training",
    "frontend",
    "demo",
]

MIDDLEWARE = [
    # Outermost: under ASGI every streamed response (static files, artifact downloads) gets an async iterator.
    "fleet.asgi_streaming.AsyncStreamingMiddleware",
    "fleet.metrics.RequestMetricsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    # Above CommonMiddleware: its slash redirect comes first; any other 404 under /api/ gets the error body.
    "core.api.errors.ApiNotFoundMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "fleet.urls"
ASGI_APPLICATION = "fleet.asgi.application"
AUTH_USER_MODEL = "accounts.User"
LOGIN_URL = "frontend:login"
LOGIN_REDIRECT_URL = "frontend:overview"
LOGOUT_REDIRECT_URL = "frontend:login"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "frontend.context.role",
            ],
        },
    }
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 10}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

STATIC_URL = "/static/"
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(BASE_DIR / "staticfiles")))
WHITENOISE_USE_FINDERS = not PRODUCTION
WHITENOISE_AUTOREFRESH = not PRODUCTION

# --- blob storage: content-addressed artifacts (base weights, adapter versions, deltas) --------------------

BLOB_STORAGE = env_str("BLOB_STORAGE", "filesystem", choices=("filesystem", "s3"))
if BLOB_STORAGE == "s3":
    _bucket = env_str("S3_BUCKET")
    if not _bucket:
        raise ImproperlyConfigured("BLOB_STORAGE=s3 needs S3_BUCKET")
    _blobs = {
        "BACKEND": "storages.backends.s3.S3Storage",
        "OPTIONS": {
            "bucket_name": _bucket,
            "endpoint_url": env_str("S3_ENDPOINT_URL"),
            "region_name": env_str("S3_REGION"),
            "access_key": env_secret("S3_ACCESS_KEY_ID"),
            "secret_key": env_secret("S3_SECRET_ACCESS_KEY"),
            "location": env_str("S3_PREFIX", "blobs"),
            "default_acl": None,
            "querystring_auth": True,
            "file_overwrite": True,  # content-addressed: the same name always holds the same bytes
        },
    }
else:
    _blobs = {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(Path(env_str("BLOB_ROOT", str(DATA_DIR / "blobs"))).resolve())},
    }
STORAGES = {
    "default": _blobs,
    "blobs": _blobs,
    "staticfiles": {
        "BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"
        if PRODUCTION
        else "django.contrib.staticfiles.storage.StaticFilesStorage"
    },
}

# --- REST API ---------------------------------------------------------------------------------------------

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "accounts.authentication.ApiTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["accounts.permissions.RolePermission"],
    "DEFAULT_PAGINATION_CLASS": "core.api.pagination.Pagination",
    "PAGE_SIZE": 50,
    "DEFAULT_FILTER_BACKENDS": [
        "core.api.filters.FilterBackend",
        "rest_framework.filters.SearchFilter",
        "rest_framework.filters.OrderingFilter",
    ],
    "DEFAULT_SCHEMA_CLASS": "core.api.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "core.api.errors.exception_handler",
    # A JSON API: forms cannot carry its nested fields. The two upload endpoints take multipart themselves.
    "DEFAULT_PARSER_CLASSES": ["core.api.parsers.BoundedJSONParser"],  # JSON nested at most 64 deep
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"]
    + (["rest_framework.renderers.BrowsableAPIRenderer"] if DEBUG else []),
    "DEFAULT_THROTTLE_RATES": {"anon": "120/min", "user": "2000/min"},
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Fleet personalization manager API",
    "DESCRIPTION": (
        "Manage a fleet of edge devices that personalize a shared model on their own data: devices, "
        "cohorts, enrollment, adapters and versions, rollouts, rounds and deltas. Authenticate with an "
        "operator API token (`Authorization: Bearer fpm_...`) or a browser session."
    ),
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "SCHEMA_PATH_PREFIX": r"/api/v1",
    "ENUM_NAME_OVERRIDES": {
        "DeviceStatusEnum": "devices.models.DeviceStatus",
        "AdapterVersionStateEnum": "training.models.AdapterVersion.State",
        "RolloutStateEnum": "training.models.Rollout.State",
        "AssignmentStateEnum": "training.models.Assignment.State",
        "AssignmentReportStatusEnum": ["delivered", "installed", "failed"],
    },
}

# --- security ---------------------------------------------------------------------------------------------

SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_SAMESITE = "Lax"
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
if PRODUCTION:
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
    # Probes and Prometheus scrape over plain HTTP inside the cluster.
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31_536_000, minimum=0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", True)
    SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", True)
    if env_bool("BEHIND_TLS_PROXY", False):
        SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

# Bearer token Prometheus presents at /metrics; signed-in operators can always read it.
METRICS_TOKEN = env_secret("METRICS_TOKEN")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {
        # Replace Django's own handlers (which would print every line twice next to the root handler).
        "django": {"handlers": ["console"], "level": "INFO", "propagate": False},
        "django.db.backends": {"level": "WARNING"},
    },
}

# --- the fleet --------------------------------------------------------------------------------------------

# Agents heartbeat at this interval (with jitter); a device silent for DEVICE_OFFLINE_AFTER_SECONDS is
# offline. Presence reaches the database every PRESENCE_FLUSH_SECONDS, in bulk.
HEARTBEAT_INTERVAL_SECONDS = env_int("HEARTBEAT_INTERVAL_SECONDS", 30, minimum=1)
DEVICE_OFFLINE_AFTER_SECONDS = env_int("DEVICE_OFFLINE_AFTER_SECONDS", 95, minimum=2)
PRESENCE_FLUSH_SECONDS = env_int("PRESENCE_FLUSH_SECONDS", 10, minimum=1)
# A heartbeat sooner than this share of the interval after the last one recorded on the socket is
# acknowledged but not recorded (``"recorded": false``); HEARTBEAT_EARLY_LIMIT of them in a row close the
# socket with 4429 (docs/protocol/README.md, "Heartbeats").
HEARTBEAT_MIN_SPACING_PERCENT = env_int("HEARTBEAT_MIN_SPACING_PERCENT", 50, minimum=0, maximum=100)
HEARTBEAT_EARLY_LIMIT = env_int("HEARTBEAT_EARLY_LIMIT", 10, minimum=1)
# Protocol 1 (signatures over Python's sorted JSON rather than RFC 8785) is accepted until the end of this
# day (UTC); afterwards a device must speak protocol 2 (docs/protocol/README.md, "Versions").
PROTOCOL_1_ACCEPTED_UNTIL = env_str("PROTOCOL_1_ACCEPTED_UNTIL", "2027-06-30")
# Each device keeps at most this many personalization reports (its personal against the shared accuracy);
# older ones are deleted as new ones arrive (devices.personalization).
PERSONALIZATION_HISTORY = env_int("PERSONALIZATION_HISTORY", 200, minimum=1, maximum=100_000)
DEVICE_TOKEN_TTL_SECONDS = env_int("DEVICE_TOKEN_TTL_SECONDS", 900, minimum=30)
ENROLLMENT_RATE = env_str("ENROLLMENT_RATE", "30/min")
DEVICE_AUTH_RATE = env_str("DEVICE_AUTH_RATE", "600/min")  # device sign-ins per client address, a bucket apart
LOGIN_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT", 10, minimum=1)
LOGIN_FAILURE_WINDOW_SECONDS = env_int("LOGIN_FAILURE_WINDOW_SECONDS", 900, minimum=10)
# A rollout's device whose assignment is still pending no longer holds the rollout open once it is offline and
# was not seen for this long (training/rollouts/progress.py); it still gets its assignment when it comes back.
ROLLOUT_GONE_SECONDS = env_int("ROLLOUT_GONE_SECONDS", 600, minimum=10)
CELERY_BEAT_SCHEDULE["tick-rollouts"] = {
    "task": "training.tasks.tick_rollouts",
    "schedule": float(env_int("ROLLOUT_TICK_SECONDS", 10, minimum=1)),
    "options": {"expires": 10},
}
CELERY_BEAT_SCHEDULE["flush-presence"] = {
    "task": "devices.tasks.flush_presence",
    "schedule": float(PRESENCE_FLUSH_SECONDS),
    "options": {"expires": PRESENCE_FLUSH_SECONDS},
}

# --- deltas and rounds ------------------------------------------------------------------------------------

# An upload above DELTA_MAX_BYTES is refused while it streams (fleet.asgi_limits), before the body is read.
DELTA_MAX_BYTES = env_int("DELTA_MAX_BYTES", 64 * 1024 * 1024, minimum=1024)
# Partial (resumable) uploads wait here; with several web servers it must be a shared volume.
DELTA_STAGING_DIR = Path(env_str("DELTA_STAGING_DIR", str(DATA_DIR / "uploads"))).resolve()
# An unfinished upload no chunk has reached for this long is discarded (a device that resumes later starts that
# file over): it no longer holds one of the device's few upload slots, nor disk. Beat sweeps every hour.
DELTA_STAGED_EXPIRY_SECONDS = env_int("DELTA_STAGED_EXPIRY_SECONDS", 6 * 3600, minimum=60)
CELERY_BEAT_SCHEDULE["expire-staged-uploads"] = {
    "task": "training.tasks.expire_staged_uploads",
    "schedule": float(min(DELTA_STAGED_EXPIRY_SECONDS, 3600)),
    "options": {"expires": 600},
}
# Limits on what one device may ask of the upload door (edge_agent/PROTOCOL.md, "Delta uploads on the socket").
# delta_begin messages per device per minute (a fixed window counted in Redis); past it the begin is refused
# `too_many_begins` with `retry_after`, before anything else is looked at.
DELTA_BEGINS_PER_MINUTE = env_int("DELTA_BEGINS_PER_MINUTE", 30, minimum=1)
# A device with this many deltas rejected in the last hour is refused `too_many_rejections` at begin (with
# `retry_after`) until the oldest of them is an hour old: a client sending garbage costs no more work.
DELTA_REJECTIONS_PER_HOUR = env_int("DELTA_REJECTIONS_PER_HOUR", 20, minimum=1)
# The envelope's signed created_at must lie within [server time - MAX_AGE, server time + MAX_AHEAD] at begin
# (`bad_created_at`): a delta trained a month ago, or by a device whose clock is years off, is not taken.
DELTA_CREATED_AT_MAX_AGE_SECONDS = env_int("DELTA_CREATED_AT_MAX_AGE_SECONDS", 30 * 24 * 3600, minimum=60)
DELTA_CREATED_AT_MAX_AHEAD_SECONDS = env_int("DELTA_CREATED_AT_MAX_AHEAD_SECONDS", 300, minimum=0)
# After a hello the server sends again the delta_result of each of the device's deltas it has not acknowledged,
# received within this many days (at most 32 per hello, oldest first).
DELTA_RESULT_RESEND_DAYS = env_int("DELTA_RESULT_RESEND_DAYS", 7, minimum=1)
ROUND_CHECK_SECONDS = env_int("ROUND_CHECK_SECONDS", 10, minimum=1)
CELERY_BEAT_SCHEDULE["close-due-rounds"] = {
    "task": "training.tasks.close_due_rounds",
    "schedule": float(ROUND_CHECK_SECONDS),
    "options": {"expires": ROUND_CHECK_SECONDS},
}
# A delta still `received` this long after it arrived lost its verification task (a worker or the broker went
# away before the task was queued or acknowledged); a beat task queues it again.
DELTA_VERIFY_RESCUE_SECONDS = env_int("DELTA_VERIFY_RESCUE_SECONDS", 300, minimum=10)
# Received deltas are verified by one drain task per shard at a time (training/federation/verify_queue.py): shards are
# how many workers verify at once; more than the worker processes is harmless.
DELTA_VERIFY_SHARDS = env_int("DELTA_VERIFY_SHARDS", 4, minimum=1, maximum=64)
# A delta whose verification was begun this many times without an outcome (its worker killed or crashing on
# it, a check raising on it) is rejected `verification_failed` at the next try, so it cannot hold its shard or
# come back from the rescue for ever. A worker killed by a fault costs an innocent delta one or two tries.
DELTA_VERIFY_MAX_ATTEMPTS = env_int("DELTA_VERIFY_MAX_ATTEMPTS", 5, minimum=1, maximum=100)
CELERY_BEAT_SCHEDULE["requeue-unverified-deltas"] = {
    "task": "training.tasks.requeue_unverified_deltas",
    "schedule": float(min(DELTA_VERIFY_RESCUE_SECONDS, 60)),
    "options": {"expires": 30},
}
# A round still `aggregating` this long after it closed, with no worker aggregating it, lost its task (a worker
# killed while holding it: the broker hands it out again only after the visibility timeout; or the broker away
# when the round closed); a beat task queues it again.
# Working memory of a robust aggregation rule's coordinate blocks (median, trimmed mean, Krum): blocks shrink
# as a round's N grows, so a worker's memory stays within this whatever the round's size.
AGGREGATION_MEMORY_BUDGET_MB = env_int("AGGREGATION_MEMORY_BUDGET_MB", 512, minimum=16)
# The worker processes a large round of the mean family is split across, one span of coordinates each (with DP,
# one shard of deltas each; all workers' processes together: containers x concurrency). Default:
# WORKER_CONCURRENCY, as `make run` starts one worker.
AGGREGATION_WORKERS = env_int(
    "AGGREGATION_WORKERS", env_int("WORKER_CONCURRENCY", min(os.cpu_count() or 1, 2), minimum=1), minimum=1
)
ROUND_AGGREGATION_RESCUE_SECONDS = env_int("ROUND_AGGREGATION_RESCUE_SECONDS", 300, minimum=10)
CELERY_BEAT_SCHEDULE["requeue-stalled-rounds"] = {
    "task": "training.tasks.requeue_stalled_rounds",
    "schedule": float(min(ROUND_AGGREGATION_RESCUE_SECONDS, 60)),
    "options": {"expires": 30},
}
# Any other request body (adapter imports, base weights) is refused past this, also while streaming.
MAX_REQUEST_BYTES = env_int("MAX_REQUEST_BYTES", 600 * 1024 * 1024, minimum=1024 * 1024)
