"""The API's ASGI handler sends Django's request signals on the event loop (infra.handlers):
that is safe only while their receivers are Django's own, which touch nothing but the
calling thread's state. A receiver added by an app (a database write, an async receiver)
must make the handler send them through a thread again."""

from __future__ import annotations

from django.core import signals
from django.core.cache import close_caches
from django.core.handlers.base import reset_urlconf
from django.db import close_old_connections, reset_queries


def _receivers(signal) -> set:
    return {ref() for _, ref, *_ in signal.receivers}


def test_the_request_signals_have_only_djangos_own_receivers():
    assert _receivers(signals.request_started) == {reset_queries, close_old_connections}
    assert _receivers(signals.request_finished) == {close_old_connections, close_caches, reset_urlconf}
