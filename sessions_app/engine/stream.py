"""Turn responses: the SSE stream of a turn, or its JSON result for `stream: "none"`.

Both follow the turn's events (events.follow) on the web process's event loop, so an open
stream costs no thread. While a turn is quiet they ping the client and check that the turn
is still alive, ending a lost one with `error` (recovery.turn_recover_if_lost). When the
event source fails (Redis down) they keep pinging and retrying; past AAP_STREAM_RETRY_SECONDS
they also ask PostgreSQL, every LIVENESS_CHECK_SECONDS, whether the turn is over. Once it is,
a `none` response answers the stored turn, and an SSE response that has sent every event from
the first sends the rest rebuilt from history and its `turn_stop` from the turn's row; one
re-attached from a later event closes (its reader re-attaches from the start, or reads
history). Only when PostgreSQL is unreachable too does a response close without an ending.
A `none` response whose events have a hole (lost in a Redis restart) answers from PostgreSQL
too: what the client is told is what history holds. While a turn waits for a worker slot, its
SSE stream says so every LIVENESS_CHECK_SECONDS with a comment `: queued {"position": n}`
instead of `: ping`, so a client tells waiting from thinking.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time

from django.conf import settings
from django.http import HttpResponse

from infra import metrics
from infra.handlers import on_web_threads
from infra.outages import DB_ERRORS, OUTAGE_ERRORS
from tenancy.authentication import token_is_active

from ..models import new_turn_id
from ..protocol import SSE_PING, dumps, event_data, fold, sse_frame
from . import events, queue, recovery, store

logger = logging.getLogger(__name__)

LIVENESS_CHECK_SECONDS = 5.0

_recover = on_web_threads(recovery.turn_recover_if_lost)
_stored_result = on_web_threads(store.turn_result)
_token_active = on_web_threads(token_is_active)
_queued_place = on_web_threads(queue.queued_place)
# Yielded by _follow when the stream's API token was revoked (or expired) meanwhile.
REVOKED = object()
# Yielded by _follow when the turn ended in PostgreSQL but its stream will never show the end
# (its events were lost with Redis): the rest can only come from history.
ENDED = object()
_rebuilt_ending = on_web_threads(store.rebuilt_ending)
REVOKED_SENTENCE = (
    "The API token of this stream was revoked or expired; the turn goes on, re-attach with a valid token."
)


class StreamInterrupted(Exception):
    """The turn's events cannot be followed to its end from here: the response closes."""


# How long a stream waits at a time for a database check before it pings instead.
CHECK_WAIT_SECONDS = 0.5
PENDING = object()  # a check's answer while PostgreSQL has not given it


class _Beside:
    """A database check run beside a stream, one at a time. The stream waits for its answer
    at most CHECK_WAIT_SECONDS at a time (PENDING meanwhile) and pings while it waits, so a
    stalled PostgreSQL delays the check's answer, never the stream's pings."""

    def __init__(self, check):
        self._check = check
        self._task: asyncio.Future | None = None

    async def answer(self, *args, patient: bool = True):
        """The check's result (or what it raised) once it has one; PENDING while it runs. A
        check just started is waited for; one already pending only when `patient`."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._check(*args))
            patient = True
        if not self._task.done():
            if patient:
                await asyncio.wait({self._task}, timeout=CHECK_WAIT_SECONDS)
            if not self._task.done():
                return PENDING
        task, self._task = self._task, None
        return task.result()

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


async def _follow(turn_id: str, after: int, token_id: int | None = None, watching: events.Watcher | None = None):
    """Events of the turn, with QUIET markers at most every LIVENESS_CHECK_SECONDS; ends
    with REVOKED once the stream's token is no longer valid (checked as often). Across
    failures of the event source: QUIET markers while it retries, then StreamInterrupted.
    `watching`: the turn's watcher since before its first event (events.follow); a retry
    after a failure watches and reads anew."""
    quiet = min(LIVENESS_CHECK_SECONDS, settings.AAP_SSE_PING_SECONDS)
    checked = time.monotonic()
    # While the event source fails: when PostgreSQL is next asked whether the turn is over.
    ask_at: float | None = None
    ended_quietly = 0  # quiet checks that found the turn over with no turn_stop in sight
    recovered, active = _Beside(_recover), _Beside(_token_active)
    try:
        while True:
            try:
                async for item in events.follow(turn_id, after, quiet_seconds=quiet, watching=watching):
                    ask_at = None
                    if token_id is not None and time.monotonic() - checked >= LIVENESS_CHECK_SECONDS:
                        valid = await active.answer(token_id, patient=item is events.QUIET)
                        if valid is not PENDING:
                            checked = time.monotonic()
                            if not valid:
                                yield REVOKED
                                return
                    if item is events.QUIET:
                        if await recovered.answer(turn_id) is True:
                            ended_quietly += 1
                            if ended_quietly > 2:  # its stream has no end any more (wiped, expired)
                                yield ENDED
                                return
                    else:
                        after = item[0]
                    yield item
                return
            except StreamInterrupted:
                raise
            except OUTAGE_ERRORS as exc:  # Redis or PostgreSQL unreachable: retry, pinging meanwhile
                watching = None
                now = time.monotonic()
                if ask_at is None:
                    ask_at = now + settings.AAP_STREAM_RETRY_SECONDS
                    logger.warning("following turn %s failed; retrying", turn_id, exc_info=True)
                if now >= ask_at:
                    # The live view is gone a while: PostgreSQL says whether the turn is over. If
                    # it is, the rest comes from history; while it runs, the stream waits.
                    ask_at = now + LIVENESS_CHECK_SECONDS
                    over = await _over_in_postgres(recovered, turn_id)
                    if over:
                        yield ENDED
                        return
                    if over is None:  # PostgreSQL is unreachable too: the client re-attaches later
                        raise StreamInterrupted(type(exc).__name__) from None
                yield events.QUIET
                await asyncio.sleep(min(1.0, quiet))
    finally:
        recovered.cancel()
        active.cancel()


async def _over_in_postgres(recovered: _Beside, turn_id: str) -> bool | None:
    """Whether the turn is over in PostgreSQL (ending it if it is lost): False while the
    check waits on a slow PostgreSQL (asked again later); None when PostgreSQL is unreachable."""
    try:
        over = await recovered.answer(turn_id)
    except OUTAGE_ERRORS:
        logger.warning("turn %s: PostgreSQL cannot say whether it is over", turn_id, exc_info=True)
        return None
    return over is True


async def _still_queued(turn_id: str) -> dict | None:
    try:
        return await _queued_place(turn_id)
    except OUTAGE_ERRORS:  # the liveness check reports what is wrong; this stream just pings
        logger.debug("the place of queued turn %s is unreadable", turn_id, exc_info=True)
        return None


def queued_comment(place: dict) -> bytes:
    return f": queued {dumps(place)}\n\n".encode()


async def _rest_from_history(turn_id: str, cursor: store.FoldCursor | None, mode: str, after: int):
    """The stream's frames from event `after` + 1 to its end, rebuilt from history once the
    turn has ended (pinging meanwhile): for a reader whose live events stopped short or have a
    hole (lost with Redis), so that what it folds is what history holds. Without a cursor, or
    when history does not have the shape the reader was shown, the response closes."""
    if cursor is None:
        raise StreamInterrupted("the turn's stream lost events this reader had not read")
    recovered = _Beside(_recover)
    try:
        while await recovered.answer(turn_id) is not True:  # it may be lost meanwhile: then it ends `error`
            yield SSE_PING
            await asyncio.sleep(LIVENESS_CHECK_SECONDS)
    finally:
        recovered.cancel()
    ending = await _rebuilt_ending(turn_id, cursor, mode)
    if ending is None:
        raise StreamInterrupted("the turn ended but its stream cannot be completed from history")
    logger.warning("turn %s: its stream lost events; the rest was rebuilt from history", turn_id)
    for offset, event in enumerate(ending, start=after + 1):
        yield sse_frame(offset, event)


async def sse_stream(
    turn_id: str,
    after: int = 0,
    token_id: int | None = None,
    mode: str = "delta",
    watching: events.Watcher | None = None,
):
    last_write = time.monotonic()
    waiting = after <= 1  # until the turn shows it started (a worker took it)
    # Where the events sent leave the reader, while they are every event from the first: if
    # the rest is lost with Redis, it is rebuilt from history (store.rebuilt_ending).
    cursor: store.FoldCursor | None = store.FoldCursor() if after <= 1 else None
    queued = _Beside(_still_queued)
    try:
        async for item in _follow(turn_id, after, token_id, watching):
            if item is REVOKED:
                yield f": {REVOKED_SENTENCE}\n\n".encode()
                return
            if item is ENDED:
                async for frame in _rest_from_history(turn_id, cursor, mode, after):
                    yield frame
                return
            now = time.monotonic()
            if item is events.QUIET:
                if waiting:
                    place = await queued.answer(turn_id)
                    if place is not PENDING:
                        if place:
                            last_write = now
                            yield queued_comment(place)
                            continue
                        waiting = False
                if now - last_write >= settings.AAP_SSE_PING_SECONDS - 0.5:
                    last_write = now
                    yield SSE_PING
                continue
            last_write = now
            seq, event = item
            waiting = waiting and seq <= 1
            if cursor is not None and seq != after + 1:
                # A hole (a batch Redis refused, or lost in a restart): the events after it would
                # fold into a wrong answer. The rest comes from history once the turn has ended.
                async for frame in _rest_from_history(turn_id, cursor, mode, after):
                    yield frame
                return
            if cursor is not None:
                cursor.feed(event)
            after = seq
            yield sse_frame(seq, event)
    finally:
        queued.cancel()


async def _stored_result_or_none(turn_id: str) -> dict | None:
    try:
        return await _stored_result(turn_id)
    except DB_ERRORS:  # PostgreSQL unreachable
        logger.warning("the stored result of turn %s is unreadable", turn_id, exc_info=True)
        return None


async def json_result(turn_id: str, token_id: int | None = None, watching: events.Watcher | None = None):
    """The `stream: "none"` body. Leading blanks keep idle connections open (valid JSON)."""
    collected: list[dict] = []
    stop: dict = {}
    last_write = time.monotonic()
    last_seq, whole = 0, True  # whole: every event from the first was seen, none skipped
    try:
        async for item in _follow(turn_id, 0, token_id, watching):
            if item is REVOKED:
                yield dumps({"error": REVOKED_SENTENCE}).encode()
                return
            if item is ENDED:
                raise StreamInterrupted("the turn ended but its stream has no turn_stop")
            if item is events.QUIET:
                if time.monotonic() - last_write >= settings.AAP_SSE_PING_SECONDS - 0.5:
                    last_write = time.monotonic()
                    yield b" "
                continue
            seq, event = item
            whole = whole and seq == last_seq + 1
            last_seq = seq
            if event["event"] == "turn_stop":
                stop = event
            elif event["event"] != "turn_start":
                collected.append(event)
        if not whole:
            # Events are missing from the live view (a Redis restart, a batch Redis refused):
            # the answer is the stored turn's, which is what history holds.
            stored = await _stored_result_or_none(turn_id)
            if stored is not None:
                yield dumps(stored).encode()
                return
    except StreamInterrupted:
        # PostgreSQL holds the finished turn's result; an unfinished one closes the response.
        stored = await _stored_result_or_none(turn_id)
        if stored is None:
            raise
        yield dumps(stored).encode()
        return
    body = {"stopReason": stop.get("stopReason", "error"), "messages": fold(collected)}
    meta = {"turnId": turn_id, **event_data(stop).get("_meta", {})}
    body["_meta"] = meta
    yield dumps(body).encode()


# The view answers with this internal header instead of a body; TurnStreamHandoff (the ASGI
# layer in front of Django) strips it and streams the turn itself. Django's request (its
# thread and database connection) is over by then, so an open stream costs neither.
HANDOFF_HEADER = "X-AAP-Turn-Stream"


def _response_head(turn_id: str, mode: str, body: bytes = b"") -> HttpResponse:
    response = HttpResponse(body, content_type="application/json" if mode == "none" else "text/event-stream")
    if mode != "none":
        response["X-Accel-Buffering"] = "no"
    response["Cache-Control"] = "no-cache"
    response["AAP-Turn-Id"] = turn_id
    return response


def turn_response(turn_id: str, mode: str, *, after: int = 0, token_id: int | None = None) -> HttpResponse:
    response = _response_head(turn_id, mode)
    response[HANDOFF_HEADER] = f"{turn_id} {mode} {after} {token_id or 0}"
    return response


def rebuilt_response(turn_id: str, mode: str) -> HttpResponse | None:
    """The whole SSE stream of a finished turn whose live events are gone, rebuilt from
    history and its row (store.rebuilt_stream), for a reader re-attaching from the start; None
    when the turn is not over."""
    rebuilt = store.rebuilt_stream(turn_id, mode)
    if rebuilt is None:
        return None
    logger.warning("turn %s: its events are gone; its stream was rebuilt from history", turn_id)
    return _response_head(turn_id, mode, b"".join(sse_frame(seq, event) for seq, event in enumerate(rebuilt, 1)))


# Requests that start a turn (by method): the hand-off chooses the new turn's id and watches
# its events before the view runs, so its stream starts with no read of what came before.
_STARTS_A_TURN = {
    "POST": re.compile(r"/v1/sessions/[^/]+/turns|/v2/session/[^/]+"),
    "PUT": re.compile(r"/v2/session"),
}
# Where the chosen id travels to the view, in the request's ASGI scope (never from the client).
CHOSEN_TURN_ID = "aap.turn_id"


def chosen_turn_id(request) -> str | None:
    """The id TurnStreamHandoff chose for the turn this request starts (its events are watched
    already); None when it chose none (another request, or Redis refused the watch)."""
    scope = getattr(request, "scope", None)
    return scope.get(CHOSEN_TURN_ID) if isinstance(scope, dict) else None


def _authorized(scope) -> bool:
    """The request carries credentials (a turn is started with a bearer token)."""
    return any(name == b"authorization" for name, _ in scope.get("headers", ()))


class TurnStreamHandoff:
    """ASGI middleware: when a view hands a turn over (HANDOFF_HEADER), send the response
    head without that header, then the turn's body from the event stream, until its end or
    until the client disconnects (the turn itself goes on). For a request that starts a
    turn, the turn's events are watched from before the view runs (chosen_turn_id)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        starts = _STARTS_A_TURN.get(scope.get("method", ""))
        if starts is None or not starts.fullmatch(scope.get("path", "")) or not _authorized(scope):
            return await self._serve(scope, receive, send)
        turn_id = new_turn_id()
        async with contextlib.AsyncExitStack() as stack:
            try:
                watcher = await stack.enter_async_context(events.backend().watch(turn_id))
            except Exception:  # a shortcut's boundary: the stream watches and reads after the view instead
                logger.warning("could not watch the events of a new turn ahead", exc_info=True)
                return await self._serve(scope, receive, send)
            await self._serve({**scope, CHOSEN_TURN_ID: turn_id}, receive, send, (turn_id, watcher))

    async def _serve(self, scope, receive, send, watched: tuple[str, events.Watcher] | None = None) -> None:
        marker = HANDOFF_HEADER.lower().encode()
        handoff: dict = {}

        async def capture(message):
            if message["type"] == "http.response.start":
                headers = message.get("headers", [])
                value = next((v for k, v in headers if k.lower() == marker), None)
                if value is not None:
                    kept = [(k, v) for k, v in headers if k.lower() not in (marker, b"content-length")]
                    handoff.update(start={**message, "headers": kept}, spec=value.decode())
                    return
            elif handoff:
                return  # the view's empty body
            await send(message)

        await self.app(scope, receive, capture)
        if handoff:
            await self._stream(handoff, receive, send, watched)

    async def _stream(self, handoff: dict, receive, send, watched: tuple[str, events.Watcher] | None) -> None:
        turn_id, mode, after, token = handoff["spec"].split(" ")
        token_id = int(token) or None
        # The watcher of the chosen id, if the view started that turn (a replayed request
        # answers with the turn it started before).
        ahead = watched[1] if watched is not None and watched[0] == turn_id and after == "0" else None
        if mode == "none":
            body = json_result(turn_id, token_id, ahead)
        else:
            body = sse_stream(turn_id, int(after), token_id, mode, ahead)
        if metrics.enabled():  # a layer per chunk: only when the metrics are read
            body = metrics.relayed(body, mode=mode, after=int(after))
        await send(handoff["start"])
        # An empty chunk makes the server write the head now (Twisted waits for body bytes), so
        # every client has `AAP-Turn-Id` at once, `stream: "none"` included.
        await send({"type": "http.response.body", "body": b"", "more_body": True})

        async def pump():
            try:
                async for chunk in body:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except StreamInterrupted as exc:
                logger.warning("closing the stream of turn %s: %s", turn_id, exc)
            except Exception:  # the response's boundary: never leave it open with nothing being sent
                logger.error("the stream of turn %s failed", turn_id, exc_info=True)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def disconnected():
            while (await receive())["type"] != "http.disconnect":
                pass

        streaming = asyncio.ensure_future(pump())
        watching = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watching):
                task.cancel()
            await asyncio.gather(streaming, watching, return_exceptions=True)
            await body.aclose()
