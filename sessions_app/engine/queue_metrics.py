"""The turn queue as Prometheus gauges, read from PostgreSQL when scraped (infra.metrics)."""

from __future__ import annotations

import logging

from django.db.models import Count
from prometheus_client.core import GaugeMetricFamily

from infra.handlers import release_connections
from infra.outages import DB_ERRORS

from ..models import Turn

logger = logging.getLogger(__name__)


class QueueCollector:
    """Turns waiting for a worker and running now, read from PostgreSQL when scraped."""

    def collect(self):
        queued = GaugeMetricFamily("aap_turns_queued", "Turns accepted and not yet started by a worker.")
        running = GaugeMetricFamily("aap_turns_running", "Turns a worker is running now.")
        try:
            rows = Turn.objects.exclude(status=Turn.DONE).values("status").annotate(n=Count("id")).order_by()
            counts = {row["status"]: row["n"] for row in rows}
        except DB_ERRORS:
            logger.warning("queue depth unavailable", exc_info=True)
            return
        finally:
            release_connections()  # the port server's thread holds no connection between scrapes
        queued.add_metric([], counts.get(Turn.QUEUED, 0))
        running.add_metric([], counts.get(Turn.RUNNING, 0))
        yield queued
        yield running
