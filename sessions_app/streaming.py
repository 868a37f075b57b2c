"""Turn responses: the SSE stream of a turn, or its JSON result for `stream: "none"`.

Both follow the turn's events (events.follow) on the web process's event loop, so an open
stream costs no thread. While a turn is quiet they ping the client and check that the turn
is still alive, ending a lost one with `error` (services.turn_recover_if_lost).
"""

from __future__ import annotations

import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import StreamingHttpResponse

from . import events, services
from .protocol import SSE_PING, dumps, event_data, fold, sse_frame

LIVENESS_CHECK_SECONDS = 5.0

_recover = sync_to_async(services.turn_recover_if_lost_released, thread_sensitive=False)


async def _follow(turn_id: str, after: int):
    """Events of the turn, with QUIET markers at most every LIVENESS_CHECK_SECONDS."""
    quiet = min(LIVENESS_CHECK_SECONDS, settings.AAP_SSE_PING_SECONDS)
    async for item in events.follow(turn_id, after, quiet_seconds=quiet):
        if item is events.QUIET:
            await _recover(turn_id)
        yield item


async def sse_stream(turn_id: str, after: int = 0):
    last_write = time.monotonic()
    async for item in _follow(turn_id, after):
        now = time.monotonic()
        if item is events.QUIET:
            if now - last_write >= settings.AAP_SSE_PING_SECONDS - 0.5:
                last_write = now
                yield SSE_PING
            continue
        last_write = now
        seq, event = item
        yield sse_frame(seq, event)


async def json_result(turn_id: str):
    """The `stream: "none"` body. Leading blanks keep idle connections open (valid JSON)."""
    collected: list[dict] = []
    stop: dict = {}
    last_write = time.monotonic()
    async for item in _follow(turn_id, 0):
        if item is events.QUIET:
            if time.monotonic() - last_write >= settings.AAP_SSE_PING_SECONDS - 0.5:
                last_write = time.monotonic()
                yield b" "
            continue
        _, event = item
        if event["event"] == "turn_stop":
            stop = event
        elif event["event"] != "turn_start":
            collected.append(event)
    body = {"stopReason": stop.get("stopReason", "error"), "messages": fold(collected)}
    meta = {"turnId": turn_id, **event_data(stop).get("_meta", {})}
    body["_meta"] = meta
    yield dumps(body).encode()


def turn_response(turn_id: str, mode: str, *, after: int = 0) -> StreamingHttpResponse:
    if mode == "none":
        response = StreamingHttpResponse(json_result(turn_id), content_type="application/json")
    else:
        response = StreamingHttpResponse(sse_stream(turn_id, after), content_type="text/event-stream")
        response["X-Accel-Buffering"] = "no"
    response["Cache-Control"] = "no-cache"
    response["AAP-Turn-Id"] = turn_id
    return response
