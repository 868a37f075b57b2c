"""Settings, read from the environment (12-factor).

Every variable is documented in README.md ("Configuration"). Secrets have no defaults in
code: when SECRET_KEY or HOSTING_ENCRYPTION_KEYS are unset, a local key is generated once
under var/ (the embedded default of `make run`), never shipped.
"""

import os
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("HOSTING_VAR_DIR", BASE_DIR / "var"))


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_list(name: str, default: str = "") -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value not in (None, "") else default


def _local_secret(filename: str, make) -> str:
    """A secret kept in var/ for local runs; generated on first use."""
    path = VAR_DIR / filename
    if path.exists():
        return path.read_text().strip()
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    value = make()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(value)
    return value


def _new_secret_key() -> str:
    import secrets

    return secrets.token_urlsafe(50)


def _new_fernet_key() -> str:
    from cryptography.fernet import Fernet

    return Fernet.generate_key().decode()


SECRET_KEY = os.environ.get("SECRET_KEY") or _local_secret("secret_key", _new_secret_key)
HOSTING_ENCRYPTION_KEYS = env_list("HOSTING_ENCRYPTION_KEYS") or [_local_secret("encryption_key", _new_fernet_key)]

DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "127.0.0.1,localhost,[::1]")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS")

# --- HTTPS (behind a TLS-terminating proxy): AAP_HTTPS=true turns every switch on ----------
AAP_HTTPS = env_bool("AAP_HTTPS", False)
# "HTTP_X_FORWARDED_PROTO,https": the header (as Django names it) and value the proxy sets.
if os.environ.get("SECURE_PROXY_SSL_HEADER"):
    SECURE_PROXY_SSL_HEADER = tuple(env_list("SECURE_PROXY_SSL_HEADER"))
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", AAP_HTTPS)
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]  # the container's healthcheck speaks plain HTTP
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000 if AAP_HTTPS else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", AAP_HTTPS)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", AAP_HTTPS)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", AAP_HTTPS)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", AAP_HTTPS)
# An admin login lasts a working day, not Django's two weeks.
SESSION_COOKIE_AGE = env_int("SESSION_COOKIE_AGE", 8 * 3600)
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
# On the HTML pages (admin, /v1/docs): only this server's scripts, styles and images.
AAP_CONTENT_SECURITY_POLICY = os.environ.get(
    "AAP_CONTENT_SECURITY_POLICY",
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'",
)

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "corsheaders",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "axes",
    "infra",
    "tenancy",
    "agents",
    "sessions_app",
]

MIDDLEWARE = [
    "infra.middleware.HostValidationMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "infra.middleware.ContentSecurityPolicyMiddleware",
    "infra.errors.BodyLimitMiddleware",
    "corsheaders.middleware.CorsMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "axes.middleware.AxesMiddleware",  # admin login lockout (last, as django-axes requires)
]

# Admin login: django-axes locks a username + address out after repeated wrong passwords.
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = env_int("AXES_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = env_float("AXES_COOLOFF_HOURS", 0.25)
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_VERBOSE = False

# The AAP API's chain (infra.handlers.ApiHandler): async-native, no sessions or CSRF
# (the API authenticates with bearer tokens); the admin keeps MIDDLEWARE.
AAP_API_MIDDLEWARE = [
    "infra.middleware.HostValidationMiddleware",
    "infra.handlers.AsyncSecurityMiddleware",
    "infra.middleware.ContentSecurityPolicyMiddleware",
    "infra.errors.BodyLimitMiddleware",
    "corsheaders.middleware.CorsMiddleware",
    "infra.handlers.AsyncXFrameOptionsMiddleware",
    "infra.limits.RateLimitHeadersMiddleware",
]

ROOT_URLCONF = "hosting.urls"
ASGI_APPLICATION = "hosting.asgi.application"

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
            ],
        },
    },
]

# --- Database -------------------------------------------------------------------------
# Threads of a web process for API views and liveness checks (infra.handlers); keep it at
# or under DATABASE_POOL_MAX so a view rarely waits for a connection.
AAP_WEB_THREADS = env_int("AAP_WEB_THREADS", 16)
DATABASE_URL = os.environ.get("DATABASE_URL", "")
if DATABASE_URL:
    DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=0)}
    if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
        # Under ASGI every request runs in its own thread, so per-thread persistent
        # connections are never reused: a pool per process serves web and worker threads.
        # A pooled connection that sat idle is checked before it is handed out: after a
        # PostgreSQL restart the dead ones are replaced instead of failing a request or a
        # turn (infra/postgres: the check is skipped for one returned moments ago).
        DATABASES["default"]["ENGINE"] = "infra.postgres"
        DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
            "min_size": env_int("DATABASE_POOL_MIN", 1),
            "max_size": env_int("DATABASE_POOL_MAX", 20),
            "timeout": env_float("DATABASE_POOL_TIMEOUT", 30.0),
            # A replacement connection that keeps failing is given up after this long (its
            # retries back off 1, 2, 4 s...): the next request that finds no connection free
            # starts a fresh one. psycopg_pool's default (300 s) lets connections terminated
            # again and again (a failover, a pooler restarting) hold the pool under strength
            # longer than `timeout`, and requests and finishing turns then fail.
            "reconnect_timeout": env_float("DATABASE_POOL_RECONNECT_SECONDS", 5.0),
        }
        # Parameters travel apart from the statement, and psycopg prepares a statement the
        # second time a connection runs it (a statement run once is never prepared):
        # PostgreSQL then skips parsing it, and after its first five runs (custom plans)
        # planning it too, most of what the turn path's statements cost it. Preparing after 5
        # runs, psycopg's default, doubled the planning a connection does as a pool grows
        # (pg_stat_statements, docs/performance.md). Set DATABASE_PREPARED_STATEMENTS=0
        # behind a pooler in transaction mode (PgBouncer before 1.21), which cannot keep them.
        if env_bool("DATABASE_PREPARED_STATEMENTS", True):
            DATABASES["default"]["OPTIONS"].update(server_side_binding=True, prepare_threshold=1)
    # The test runner's database; scripts/test.sh makes it unique per run so two checkouts'
    # suites can share one PostgreSQL server.
    if os.environ.get("DATABASE_TEST_NAME"):
        DATABASES["default"]["TEST"] = {"NAME": os.environ["DATABASE_TEST_NAME"]}
else:
    # Embedded default for local runs only: one SQLite file under var/.
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(VAR_DIR / "db.sqlite3"),
            "OPTIONS": {
                "transaction_mode": "IMMEDIATE",
                "timeout": 20,
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Redis, Celery, events --------------------------------------------------------------
# Without REDIS_URL the web process runs turns itself in background threads with an
# in-process event stream (the embedded mode of `make run`).
REDIS_URL = os.environ.get("REDIS_URL", "")
# Redis connections per process and event loop (callers wait for a free one beyond it).
REDIS_POOL_MAX = env_int("REDIS_POOL_MAX", 50)
CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_TASK_IGNORE_RESULT = True
# Celery carries no turn: turns wait in PostgreSQL, and workers hear of them there
# (sessions_app.engine.worker). What it carries (an MCP server listing, a wake-up where the
# database is SQLite, beat's sweep) is safe to lose or to run twice; a message leaves Redis
# when a worker takes it, so Kombu's Redis ack emulation is off.
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_DISABLE_PREFETCH = env_bool("AAP_WORKER_DISABLE_PREFETCH", True)
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "ack_emulation": False,
    "socket_timeout": 10,
    "socket_connect_timeout": 5,
}
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_QUEUE = "aap-turns"
# Every worker also consumes its own direct queue: a turn answering a prompt that one
# worker holds (ACP permissions) is sent there.
CELERY_WORKER_DIRECT = True
CELERY_BEAT_SCHEDULE = {
    "sweep-stale-turns": {"task": "sessions_app.tasks.sweep_stale_turns", "schedule": 10.0},
}

# --- AAP --------------------------------------------------------------------------------
AAP_PUBLIC_META = env_bool("AAP_PUBLIC_META", True)
# Largest request body accepted, in bytes (413 beyond it).
AAP_MAX_BODY_BYTES = env_int("AAP_MAX_BODY_BYTES", 10 * 1024 * 1024)
# Requests refused by their size in items before any per-message validation, and from 64 KiB
# before the body is parsed into Python objects (sessions_app/api/services/validation:
# check_body_size, check_request_size): a body under the byte limit can still hold 200,000
# tiny messages.
AAP_MAX_TURN_MESSAGES = env_int("AAP_MAX_TURN_MESSAGES", 256)
AAP_MAX_SEED_MESSAGES = env_int("AAP_MAX_SEED_MESSAGES", 2000)
AAP_MAX_CONTENT_PARTS = env_int("AAP_MAX_CONTENT_PARTS", 64)
AAP_MAX_REQUEST_TOOLS = env_int("AAP_MAX_REQUEST_TOOLS", 128)
DATA_UPLOAD_MAX_MEMORY_SIZE = AAP_MAX_BODY_BYTES
# A request's line and headers, then its body, must arrive within these (408 otherwise).
AAP_REQUEST_HEADERS_TIMEOUT_SECONDS = env_float("AAP_REQUEST_HEADERS_TIMEOUT_SECONDS", 10.0)
AAP_REQUEST_BODY_TIMEOUT_SECONDS = env_float("AAP_REQUEST_BODY_TIMEOUT_SECONDS", 60.0)
# A response waits this long for a client that reads nothing (its socket buffer full),
# then the connection is dropped (a stream's client re-attaches; infra/server_limits).
AAP_RESPONSE_STALL_SECONDS = env_float("AAP_RESPONSE_STALL_SECONDS", 60.0)
# How long a turn's events can be replayed after it ends.
AAP_EVENT_RETENTION_SECONDS = env_int("AAP_EVENT_RETENTION_SECONDS", 3600)
# How long a running turn's event stream is kept at most (longer than any turn runs).
AAP_LIVE_EVENTS_TTL_SECONDS = env_int("AAP_LIVE_EVENTS_TTL_SECONDS", 24 * 3600)
# How long an `AAP-Events-Ticket` (EventSource re-attach without headers) stays valid.
AAP_EVENTS_TICKET_SECONDS = env_int("AAP_EVENTS_TICKET_SECONDS", 3600)
AAP_SSE_PING_SECONDS = env_float("AAP_SSE_PING_SECONDS", 15.0)
# A running turn refreshes a lease; a turn whose lease lapses is declared lost.
AAP_TURN_LEASE_SECONDS = env_float("AAP_TURN_LEASE_SECONDS", 10.0)
# A worker with a free thread looks for waiting turns this often, besides its wake-ups (a
# wake-up lost with Redis, or taken by a busy worker, costs at most this much latency).
AAP_WORKER_POLL_SECONDS = env_float("AAP_WORKER_POLL_SECONDS", 1.0)
# The queue this deployment's turns wait in, in PostgreSQL: its workers claim only those. Two
# deployments that share one database but not one Redis must each have their own (a turn's
# events go to the Redis of the worker that runs it, and its clients follow their web's).
AAP_TURN_QUEUE = os.environ.get("AAP_TURN_QUEUE", "default")
# A turn pinned to the worker that holds its prompt (an answer to a permission request)
# goes to any worker once it waited this long (the holder is gone).
AAP_TURN_PIN_SECONDS = env_float("AAP_TURN_PIN_SECONDS", 30.0)
# A stream whose event source fails keeps pinging and retrying this long, then closes.
AAP_STREAM_RETRY_SECONDS = env_float("AAP_STREAM_RETRY_SECONDS", 30.0)
# How long a worker retries its claim or finish of a turn while PostgreSQL is unreachable.
AAP_DB_RETRY_SECONDS = env_float("AAP_DB_RETRY_SECONDS", 60.0)
# A pooled connection idle this long is checked before use (infra/postgres).
AAP_DB_CHECK_IDLE_SECONDS = env_float("AAP_DB_CHECK_IDLE_SECONDS", 1.0)
# How long an Idempotency-Key is remembered.
AAP_IDEMPOTENCY_SECONDS = env_int("AAP_IDEMPOTENCY_SECONDS", 24 * 3600)
# Threads of the web process that run turns in the embedded mode (no REDIS_URL).
AAP_EMBEDDED_WORKERS = env_int("AAP_EMBEDDED_WORKERS", 8)
# An ACP agent process being stopped (idle, worker shutdown, deploy) gets its stdin closed and
# this long to exit (agents save their sessions then) before SIGTERM, then SIGKILL. A worker's
# shutdown stops all of them at once, within this plus 15 seconds.
AAP_ACP_STOP_GRACE_SECONDS = env_float("AAP_ACP_STOP_GRACE_SECONDS", 10.0)
# Root of per-session workspaces (ACP agents).
AAP_WORKSPACE_ROOT = Path(os.environ.get("AAP_WORKSPACE_ROOT", VAR_DIR / "workspaces"))
# The ACP sandbox (docs/acp-agents.md): when the service runs as root, each isolation unit's
# agents run as a uid of its own from this range; a running unit is checked against its
# limits this often.
AAP_SANDBOX_UID_BASE = env_int("AAP_SANDBOX_UID_BASE", 200000)
AAP_SANDBOX_UID_COUNT = env_int("AAP_SANDBOX_UID_COUNT", 100000)
AAP_SANDBOX_MONITOR_SECONDS = env_float("AAP_SANDBOX_MONITOR_SECONDS", 1.0)
# How agents are walled in: "namespaces" (bubblewrap: their own user, mount, PID, IPC and
# network namespaces), "fallback" (Landlock + seccomp over the shared host), or "auto"
# (namespaces where the host allows them, else the fallback, with a log line saying why).
AAP_SANDBOX_MODE = os.environ.get("AAP_SANDBOX_MODE", "auto")
if AAP_SANDBOX_MODE not in ("auto", "namespaces", "fallback"):
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("AAP_SANDBOX_MODE must be auto, namespaces or fallback.")
# A delegated cgroup v2 directory for the units' cgroups ("" = find one; "off" = none).
AAP_SANDBOX_CGROUP = os.environ.get("AAP_SANDBOX_CGROUP", "")

# Per-tenant limits (sessions_app.api.admission): defaults for tenants that set none; 0 = no limit.
AAP_TENANT_MAX_RUNNING_TURNS = env_int("AAP_TENANT_MAX_RUNNING_TURNS", 16)
AAP_TENANT_MAX_QUEUED_TURNS = env_int("AAP_TENANT_MAX_QUEUED_TURNS", 64)
AAP_TENANT_TURNS_PER_MINUTE = env_int("AAP_TENANT_TURNS_PER_MINUTE", 600)
AAP_TENANT_MAX_SESSIONS = env_int("AAP_TENANT_MAX_SESSIONS", 0)
AAP_TENANT_TOKENS_PER_DAY = env_int("AAP_TENANT_TOKENS_PER_DAY", 0)
# Retry-After of a 429 for running/queued turns or sessions (when a place frees is unknown).
AAP_LIMITS_RETRY_SECONDS = env_int("AAP_LIMITS_RETRY_SECONDS", 2)
# Failed bearer tokens per client address and minute before 429s (no database query then).
AAP_AUTH_FAILURES_PER_MINUTE = env_int("AAP_AUTH_FAILURES_PER_MINUTE", 30)
# Seconds a process remembers a token it found active (0: look it up on every request): a
# revoked token, a disabled tenant or changed tenant limits reach new requests within this bound.
AAP_AUTH_CACHE_SECONDS = env_float("AAP_AUTH_CACHE_SECONDS", 5.0)
# Per-turn output bounds (sessions_app.engine.host): stream entries and text bytes.
AAP_TURN_MAX_EVENTS = env_int("AAP_TURN_MAX_EVENTS", 10000)
AAP_TURN_MAX_OUTPUT_BYTES = env_int("AAP_TURN_MAX_OUTPUT_BYTES", 4 * 1024 * 1024)
# While a turn's events wait for Redis, tiny deltas join for up to this long into one entry;
# a turn whose entries have waited this long behind a write joins its new deltas (backpressure).
AAP_TURN_COALESCE_SECONDS = env_float("AAP_TURN_COALESCE_SECONDS", 0.02)

# --- DRF and the OpenAPI document --------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["tenancy.authentication.BearerTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["tenancy.authentication.IsTenant"],
    "DEFAULT_PARSER_CLASSES": ["infra.errors.LimitedJSONParser"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "infra.errors.ProtocolContentNegotiation",
    "EXCEPTION_HANDLER": "infra.errors.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "AAP v3 hosting API",
    "DESCRIPTION": "Agent Application Protocol v3: discover agents, run sessions and turns, stream events. "
    "Under /v2/: the same sessions for clients of the earlier (v2-era) wire format.",
    "VERSION": "3",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    # 3.1: schemas are JSON Schema 2020-12 (the SSE events' contentSchema needs it).
    "OAS_VERSION": "3.1.0",
    # Bearer auth (hosting.openapi.BearerTokenScheme), wire shapes, streams, links, common errors.
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "hosting.openapi.postprocess"],
}

CORS_ALLOWED_ORIGINS = env_list("CORS_ALLOWED_ORIGINS")
CORS_EXPOSE_HEADERS = ["AAP-Turn-Id", "AAP-Events-Ticket", "Retry-After", "RateLimit", "RateLimit-Policy"]
CORS_ALLOW_HEADERS = ["accept", "authorization", "content-type", "last-event-id", "idempotency-key"]

# --- Static files, i18n -----------------------------------------------------------------
STATIC_URL = "/static/"
STATIC_ROOT = Path(os.environ.get("STATIC_ROOT", BASE_DIR / "staticfiles"))
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# --- Logging: never a secret, never a request body ---------------------------------------
# JSON lines (LOG_FORMAT=plain: text) with the tenant, session and turn ids of the work at
# hand (infra/logs.py); Celery's lines about the routine sweep are at DEBUG.
LOG_LEVEL = os.environ.get("LOG_LEVEL", "INFO").upper()
LOG_FORMAT = os.environ.get("LOG_FORMAT", "json").strip().lower()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "json": {"()": "infra.logs.json_formatter"},
        "plain": {"()": "infra.logs.PlainFormatter", "format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
    },
    "filters": {
        "ids": {"()": "infra.logs.ContextFilter"},
        "routine": {"()": "infra.logs.RoutineTaskFilter"},
        "task_failures": {"()": "infra.logs.TaskFailureFilter"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "plain" if LOG_FORMAT == "plain" else "json",
            "filters": ["routine", "task_failures", "ids"],
        },
    },
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "django.request": {"level": "ERROR"},
        "httpx": {"level": "WARNING"},
        "httpx2": {"level": "WARNING"},  # the openai SDK's transport logs full URLs at INFO
        "openai": {"level": "WARNING"},
    },
}
# Celery workers and beat log through the handler above instead of replacing it.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# --- Observability: metrics, traces, the /try/ page (docs/observability.md) ---------------
# off | token (/metrics behind AAP_METRICS_TOKEN) | port (an internal port, no auth).
AAP_METRICS = os.environ.get("AAP_METRICS", "off").strip().lower() or "off"
AAP_METRICS_TOKEN = os.environ.get("AAP_METRICS_TOKEN", "")
AAP_METRICS_PORT = env_int("AAP_METRICS_PORT", 9464)
AAP_METRICS_ADDR = os.environ.get("AAP_METRICS_ADDR", "127.0.0.1")
if AAP_METRICS not in ("off", "token", "port"):
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(f"AAP_METRICS must be off, token or port (got {AAP_METRICS!r}).")
if AAP_METRICS == "token" and len(AAP_METRICS_TOKEN) < 16:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("AAP_METRICS=token needs AAP_METRICS_TOKEN of at least 16 characters.")
if AAP_METRICS != "off":
    # prometheus_client's multiprocess mode: every web and worker process of a host writes here.
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", str(VAR_DIR / "metrics"))
    Path(os.environ["PROMETHEUS_MULTIPROC_DIR"]).mkdir(parents=True, exist_ok=True)
    MIDDLEWARE = ["infra.metrics.RequestMetricsMiddleware", *MIDDLEWARE]
    AAP_API_MIDDLEWARE = ["infra.metrics.RequestMetricsMiddleware", *AAP_API_MIDDLEWARE]
# Traces are opt-in with the standard OTEL_* variables: without an OTLP endpoint nothing is set up.
AAP_TRACING = (
    bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    and not env_bool("OTEL_SDK_DISABLED", False)
    and os.environ.get("OTEL_TRACES_EXPORTER", "otlp") != "none"
)
if AAP_TRACING:
    MIDDLEWARE = ["infra.tracing.TracingMiddleware", *MIDDLEWARE]
    AAP_API_MIDDLEWARE = ["infra.tracing.TracingMiddleware", *AAP_API_MIDDLEWARE]
# The /try/ chat page (a browser client of the public API); off unless enabled.
AAP_TRY_PAGE = env_bool("AAP_TRY_PAGE", False)
