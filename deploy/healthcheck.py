"""Container healthchecks: `python deploy/healthcheck.py web|worker|beat` exits 0 when healthy.

web     GET /healthz with a Host header taken from ALLOWED_HOSTS, so it passes whatever
        public names the operator allows (the request itself goes to 127.0.0.1).
worker  this container's Celery worker answers a ping over the broker.
beat    the schedule file was written recently (beat saves it at least every 3 minutes).
"""

from __future__ import annotations

import os
import socket
import sys
import time
import urllib.request


def allowed_host() -> str:
    """A Host header the service accepts: the first usable ALLOWED_HOSTS entry."""
    for entry in os.environ.get("ALLOWED_HOSTS", "127.0.0.1").split(","):
        entry = entry.strip()
        if not entry:
            continue
        if entry == "*":
            return "127.0.0.1"
        if entry.startswith("."):
            return "healthcheck" + entry  # a subdomain pattern: any name under it matches
        return entry
    return "127.0.0.1"


def web() -> int:
    port = os.environ.get("PORT", "8000")
    request = urllib.request.Request(f"http://127.0.0.1:{port}/healthz", headers={"Host": allowed_host()})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310 (a fixed http:// URL)
            return 0 if response.status == 200 else 1
    except Exception as exc:
        print(f"web unhealthy: {exc}", file=sys.stderr)
        return 1


def worker() -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hosting.settings")
    from hosting.celery import app

    node = f"celery@{socket.gethostname()}"
    replies = app.control.ping(destination=[node], timeout=5.0)
    if not replies:
        print(f"worker unhealthy: {node} did not answer a ping", file=sys.stderr)
        return 1
    return 0


def beat() -> int:
    var_dir = os.environ.get("HOSTING_VAR_DIR", "/data/var")
    candidates = (
        [os.path.join(var_dir, name) for name in os.listdir(var_dir) if name.startswith("celerybeat-schedule")]
        if os.path.isdir(var_dir)
        else []
    )
    newest = max((os.path.getmtime(path) for path in candidates), default=0.0)
    if time.time() - newest > float(os.environ.get("AAP_BEAT_STALE_SECONDS", "400")):
        print("beat unhealthy: its schedule file has not been written for too long", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    checks = {"web": web, "worker": worker, "beat": beat}
    if len(sys.argv) != 2 or sys.argv[1] not in checks:
        print(f"usage: {sys.argv[0]} {'|'.join(checks)}", file=sys.stderr)
        sys.exit(2)
    sys.exit(checks[sys.argv[1]]())
