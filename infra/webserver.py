"""The web process: Daphne's own command line, with its access log written through logging.

Daphne writes access lines in NCSA text to stdout, the full URI included; its command line
takes the server class to build (`CommandLineInterface.server_class`), and that server takes
an `action_logger`. This module gives it one that logs each HTTP response as a record of the
`hosting.access` logger — so the lines are JSON like every other (LOG_FORMAT), with the
method, the route it matched, the status, the duration and the size — and never the query
string, where events tickets (bearer capabilities) travel. Health and metrics probes log at
DEBUG, so a container's healthcheck does not write a line every few seconds.

    python -m infra.webserver -b 0.0.0.0 -p 8000 hosting.asgi:application   (deploy/entrypoint.sh)

Every option is Daphne's; `--access-log` and `-v` still choose where its own lines would go,
but access records always go through logging (level: LOG_LEVEL; logger `hosting.access`).

Large blocks of memory go back to the system when freed (`return_large_blocks`). glibc
serves a block from the heap instead of its own mapping once a block of that size was freed
(its threshold rises to 32 MiB), and each view thread has a heap (an arena) of its own, up
to 8 per core. A request body near AAP_MAX_BODY_BYTES is read and scanned on one of the
AAP_WEB_THREADS view threads: sent one after another, such bodies landed on different
threads, and each thread's heap kept their freed megabytes (Daphne's RSS 165 → 495 MB after
20 refused bodies of 7 MB, `make bench` scenario 13; 170 MB with the threshold held).
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

from daphne.cli import CommandLineInterface
from daphne.server import Server

logger = logging.getLogger("hosting.access")

#: Probes that answer every few seconds: their lines are DEBUG.
QUIET_PATHS = frozenset({"/healthz", "/metrics"})


def route_of(path: str) -> str:
    """The URL pattern a path resolves to (`/v1/sessions/<str:session_id>/turns`): bounded,
    id-free; `-` for a path no pattern matches."""
    from django.urls import Resolver404, resolve

    try:
        match = resolve(path)
    except Resolver404:
        return "-"
    except Exception:  # a malformed path is not the access log's business
        logger.debug("no route for the access log", exc_info=True)
        return "-"
    return "/" + match.route if match.route else "-"


class AccessLog:
    """Daphne's action logger: one `hosting.access` record per HTTP response."""

    def __call__(self, protocol: str, action: str, details: dict[str, Any]) -> None:
        if protocol != "http" or action != "complete":
            return
        path = str(details.get("path") or "").split("?", 1)[0]
        level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
        if not logger.isEnabledFor(level):
            return
        method, status, route = details.get("method", "-"), details.get("status"), route_of(path)
        logger.log(
            level,
            "%s %s %s",
            method,
            route,
            status,
            extra={
                "method": method,
                "route": route,
                "status": status,
                "duration_ms": round(float(details.get("time_taken") or 0) * 1000, 1),
                "bytes": details.get("size"),
                "client": (details.get("client") or "").rsplit(":", 1)[0] or None,
            },
        )


class LoggingServer(Server):
    """Daphne's server with the access log above, whatever the command line asked for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["action_logger"] = AccessLog()
        super().__init__(*args, **kwargs)


class WebCommandLine(CommandLineInterface):
    server_class = LoggingServer


# glibc's mallopt() parameter for the size from which a block gets a mapping of its own (<malloc.h>).
M_MMAP_THRESHOLD = -3
#: Blocks of this size and larger are mapped on their own and unmapped when freed.
LARGE_BLOCK_BYTES = 1 << 20


def return_large_blocks(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """Hold glibc's mmap threshold at `threshold` bytes, so that a freed large block goes back
    to the system instead of staying in a thread's heap; True when glibc took the setting.
    An operator's MALLOC_MMAP_THRESHOLD_ (read by glibc itself) stands; another C library is
    left as it is."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc: no such call
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))


def main(argv: list[str] | None = None) -> None:
    return_large_blocks()
    WebCommandLine().run(argv)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
