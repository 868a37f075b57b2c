"""Observability helpers without I/O: bounded metric labels, the 429 limit name, the usage
query's validation and the metrics token check."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from django.http import HttpResponse
from django.test import RequestFactory, override_settings

from infra import metrics
from infra.service_errors import BadRequest
from sessions_app.api.selectors import usage_query


def test_label_values_beyond_the_cap_read_as_other():
    capped = metrics._Capped(cap=3)
    assert [capped(name) for name in ("a", "b", "c", "d", "a", "e")] == ["a", "b", "c", "other", "a", "other"]
    roomy = metrics._Capped(cap=5)
    assert roomy("") == "unknown"
    assert roomy("x" * 500) == "x" * 100  # a label value is never longer than 100 characters


@pytest.mark.parametrize(
    "header, name",
    [
        ('"tenant-turns";q=10;w=60', "tenant-turns"),
        ("concurrent;q=2", "concurrent"),
        ("", "unknown"),
        (None, "unknown"),
    ],
)
def test_a_429_is_counted_under_its_policy_name(header, name):
    response = HttpResponse(status=429)
    if header is not None:
        response["RateLimit-Policy"] = header
    assert metrics._policy_name(response) == name


def test_a_429_is_counted_under_the_limit_its_body_names():
    from rest_framework.response import Response

    response = Response({"error": "...", "details": {"limit": "runningTurns"}}, status=429)
    response["RateLimit-Policy"] = '"turns";q=3;w=60'
    assert metrics._policy_name(response) == "runningTurns"


def test_usage_query_defaults_to_the_last_30_days_by_agent():
    query = usage_query({})
    assert query["group_by"] == "agent"
    assert query["end"] - query["start"] == timedelta(days=30)
    assert abs((datetime.now(UTC) - query["end"]).total_seconds()) < 60


def test_usage_query_reads_dates_as_utc_midnight_and_times_with_their_offset():
    query = usage_query({"from": "2026-11-01", "to": "2026-11-02T12:30:00+02:00", "groupBy": "day"})
    assert query["start"] == datetime(2026, 11, 1, tzinfo=UTC)
    assert query["end"] == datetime(2026, 11, 2, 10, 30, tzinfo=UTC)


@pytest.mark.parametrize(
    "params",
    [
        {"groupBy": "tenant"},
        {"from": "soon"},
        {"from": "2026-02-01", "to": "2026-01-31"},
        {"from": "2024-01-01", "to": "2026-01-01"},
    ],
)
def test_bad_usage_queries_raise_a_sentence(params):
    with pytest.raises(BadRequest) as refused:
        usage_query(params)
    assert refused.value.message.endswith(".")


def test_the_metrics_view_compares_the_token_and_never_echoes_it(monkeypatch):
    monkeypatch.setattr(metrics, "_MODE", "token")
    factory = RequestFactory()
    with override_settings(AAP_METRICS_TOKEN="the-right-token-0123456789"):
        wrong = metrics.metrics_view(factory.get("/metrics", HTTP_AUTHORIZATION="Bearer the-wrong-token"))
        assert wrong.status_code == 401 and b"the-wrong-token" not in wrong.content
        assert metrics.metrics_view(factory.get("/metrics", HTTP_AUTHORIZATION="Basic x")).status_code == 401
        monkeypatch.setattr(metrics, "registry", lambda: metrics.CollectorRegistry())
        right = metrics.metrics_view(factory.get("/metrics", HTTP_AUTHORIZATION="Bearer the-right-token-0123456789"))
        assert right.status_code == 200 and right["Content-Type"].startswith("text/plain")


def test_a_relayed_stream_is_open_until_its_body_ends():
    async def body():
        yield b"id: 1\nevent: turn_start\ndata: {}\n\n"
        yield b": ping\n\n"
        yield b"id: 2\nevent: text_delta\ndata: {}\n\n"

    gauge = metrics.OPEN_STREAMS.labels("sse")
    events = metrics.EVENTS_RELAYED.labels("delta")

    async def run():
        before_open, before_events = gauge._value.get(), events._value.get()
        seen_open = []
        async for _ in metrics.relayed(body(), mode="delta", after=0):
            seen_open.append(gauge._value.get() - before_open)
        return seen_open, gauge._value.get() - before_open, events._value.get() - before_events

    seen_open, after, relayed = asyncio.run(run())
    assert seen_open == [1, 1, 1] and after == 0
    assert relayed == 2  # the ping is not an event


def test_closing_a_relayed_stream_closes_the_turns_follower():
    closed = []

    async def follower():
        try:
            while True:
                yield b"id: 1\nevent: text_delta\ndata: {}\n\n"
        finally:
            closed.append(True)

    async def run():
        wrapped = metrics.relayed(follower(), mode="delta", after=0)
        await wrapped.__anext__()
        await wrapped.aclose()  # what TurnStreamHandoff does when the client goes away
        return list(closed)  # at once, not when the loop shuts its generators down

    assert asyncio.run(run()) == [True]


def test_a_turns_wait_is_observed_from_its_acceptance_when_a_worker_claims_it():
    def observed() -> tuple[float, float]:
        samples = {s.name: s.value for s in metrics.QUEUE_WAIT.collect()[0].samples}
        return samples["aap_turn_queue_wait_seconds_count"], samples["aap_turn_queue_wait_seconds_sum"]

    count, total = observed()
    metrics.turn_claimed(2.5)
    metrics.turn_claimed(-0.01)  # clocks of two hosts: never a negative wait
    assert observed() == (count + 2, total + 2.5)


def test_a_usage_window_at_the_edge_of_the_calendar_is_a_400_not_a_crash():
    with pytest.raises(BadRequest):
        usage_query({"to": "0001-01-02"})
    query = usage_query({"from": "9999-12-01", "to": "9999-12-31"})
    assert query["end"] - query["start"] == timedelta(days=30)
