# syntax=docker/dockerfile:1
# aap-hosting: one image for every service of docker-compose.yml (web, worker, beat, init);
# deploy/entrypoint.sh picks the role from the command.
#
#   docker build -t aap-hosting .
#   docker build --build-arg ACP=1 --build-arg NPM_PACKAGES="@scope/some-acp-agent" -t aap-hosting:acp .
#
# ACP=1 adds what ACP agents need: agentao (a Python ACP agent) and Node.js with npm, for
# agents distributed on npm (NPM_PACKAGES: installed globally, so their commands are on PATH).
# Configuration comes from the environment at run time (DATABASE_URL, REDIS_URL,
# SECRET_KEY, HOSTING_ENCRYPTION_KEYS, ALLOWED_HOSTS, ...); no secret is baked in.
FROM python:3.11-slim

ARG ACP=0
ARG NPM_PACKAGES=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# bubblewrap: the worker starts each ACP agent in namespaces of its own (user, mount, pid, ipc,
# net, uts) as the unprivileged service user; its container needs deploy/seccomp-worker.json
# (docs/acp-agents.md, "In Docker compose"). Small (libcap2, libselinux1), so in every image.
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/*

# ACP agents: Node.js and npm from Debian, agentao from PyPI, npm agents globally.
RUN if [ "$ACP" = "1" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends nodejs npm \
        && rm -rf /var/lib/apt/lists/* \
        && pip install 'agentao>=0.5.17' \
        && if [ -n "$NPM_PACKAGES" ]; then npm install --global $NPM_PACKAGES && npm cache clean --force; fi; \
    fi

# Dependencies first, from the lock file alone (exact versions and hashes, `make lock`
# writes it from pyproject.toml and sdk/pyproject.toml), so code changes do not reinstall them.
COPY requirements.lock ./
RUN pip install --require-hashes -r requirements.lock

# The project itself: the AAP client (sdk/, `aap-client`, which the service depends on) and
# the service, non-editable, their dependencies already installed from the lock. .dockerignore
# keeps .venv, var/, .git, .env*, backups and dumps, and the operator's deploy/agents.yaml out
# (tests/unit/test_image_context.py).
COPY . .
RUN pip install --no-deps ./sdk . \
    && rm -rf build ./*.egg-info sdk/build sdk/*.egg-info

# Run from the copied tree (manage.py; settings' BASE_DIR = /app); mutable state lives
# under /data (mount volumes there: /data/workspaces is shared by web and worker).
ENV PYTHONPATH=/app \
    DJANGO_SETTINGS_MODULE=hosting.settings \
    HOSTING_VAR_DIR=/data/var \
    AAP_WORKSPACE_ROOT=/data/workspaces \
    STATIC_ROOT=/app/staticfiles \
    APP_DIR=/app

# Static files at build time. Throwaway secrets exist only in this RUN's environment (not
# baked in as ENV); without them settings would generate and store local ones.
RUN SECRET_KEY="collectstatic-build-only" \
    HOSTING_ENCRYPTION_KEYS="$(python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())')" \
    HOSTING_VAR_DIR=/tmp/build-var \
    python manage.py collectstatic --noinput -v0 \
    && rm -rf /tmp/build-var

RUN groupadd --system --gid 10001 aap \
    && useradd --system --uid 10001 --gid aap --home-dir /data --no-create-home --shell /usr/sbin/nologin aap \
    && mkdir -p /data/var /data/workspaces \
    && chown -R aap:aap /data \
    && chmod 0755 /app/deploy/entrypoint.sh
USER 10001:10001
ENV HOME=/data

EXPOSE 8000
ENTRYPOINT ["/app/deploy/entrypoint.sh"]
CMD ["web"]
