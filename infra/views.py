"""Operational endpoints."""

import logging

from django.db import connection
from django.http import JsonResponse

from . import redis_connections

logger = logging.getLogger(__name__)


def healthz(request):
    """200 when the database (and Redis, when configured) answer; 503 naming what failed."""
    checks, failed = {}, []
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["database"] = "ok"
    except Exception as exc:  # the probe reports any failure as unreachable
        logger.warning("health check: the database is unreachable", exc_info=True)
        checks["database"] = f"unreachable ({type(exc).__name__})"
        failed.append("database")
    connections = redis_connections.connections()
    if connections is not None:
        try:
            connections.sync.ping()
            checks["redis"] = "ok"
        except Exception as exc:  # the probe reports any failure as unreachable
            logger.warning("health check: Redis is unreachable", exc_info=True)
            checks["redis"] = f"unreachable ({type(exc).__name__})"
            failed.append("redis")
    else:
        checks["redis"] = "not configured (embedded mode)"
    if failed:
        return JsonResponse(
            {"status": "unhealthy", "error": f"Unreachable: {', '.join(failed)}.", "checks": checks}, status=503
        )
    return JsonResponse({"status": "ok", "checks": checks})
