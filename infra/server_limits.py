"""Limits Daphne enforces while a request arrives, before any application code runs.

Twisted buffers a whole request body before Daphne hands it to the application, so a limit
checked in Django comes too late: a 1 GiB upload has already been read (and a declared
length that never arrives holds the connection). Here, at the HTTP channel:

- a declared `Content-Length` over `AAP_MAX_BODY_BYTES` is answered 413 at once; a chunked
  body is counted as it arrives and answered 413 as soon as it passes the limit;
- the request line and headers must arrive within `AAP_REQUEST_HEADERS_TIMEOUT_SECONDS` and
  the body within `AAP_REQUEST_BODY_TIMEOUT_SECONDS` of the headers (408 otherwise), so a
  slow client (slowloris) cannot hold a connection by trickling bytes;
- malformed HTTP that Twisted or Daphne refuse themselves (oversized headers, a bad
  `Content-Length` or chunk size, an invalid header name) gets the API's JSON 400 instead
  of a bare status line or an HTML page.

Each refusal closes the connection: the response is written, the sending side is shut, the
rest of the upload is discarded for a moment (so the client can read the answer instead of
a reset) and the connection is then dropped.

And while a response goes out: Daphne writes whatever the application sends into Twisted's
send buffer, which has no bound, so a client that stops reading a long stream (or dozens of
them re-attaching to a large turn) would hold the whole of it in the web process. Each
response registers a push producer with its request (Twisted's public flow control): once
the socket's buffer is full, Twisted pauses it, and the application's next `send` waits
until the client has read it. A stream's pump waits with it, so a slow client costs a
socket buffer, not the turn; a client that reads nothing for `AAP_RESPONSE_STALL_SECONDS`
is dropped (it re-attaches from the last event it read; the turn goes on).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from django.conf import settings
from twisted.internet.interfaces import IPushProducer
from zope.interface import implementer

logger = logging.getLogger(__name__)

# Seconds a refused connection keeps discarding what the client still sends before it is dropped.
LINGER_SECONDS = 2.0

REASONS = {400: b"Bad Request", 408: b"Request Timeout", 413: b"Content Too Large"}


def _response(status: int, message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    head = b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % (
        status,
        REASONS[status],
        len(body),
    )
    return head + body


def too_large_message() -> str:
    return f"The request body is larger than the limit of {settings.AAP_MAX_BODY_BYTES} bytes."


def refuse(channel, status: int, message: str) -> None:
    """Answer `status` on the channel and close it (once), discarding further input."""
    if getattr(channel, "_aap_refused", False) or channel.transport is None:
        return
    channel._aap_refused = True
    _cancel_deadline(channel)
    channel.setTimeout(None)
    # Nothing more is parsed or handed to the application from this connection.
    channel.dataReceived = channel.rawDataReceived = channel.lineReceived = lambda *args: None
    transport = channel.transport
    transport.write(_response(status, message))
    if hasattr(transport, "loseWriteConnection"):
        transport.loseWriteConnection()
        channel.callLater(LINGER_SECONDS, transport.abortConnection)
    else:
        transport.loseConnection()


def _cancel_deadline(channel) -> None:
    call = getattr(channel, "_aap_deadline", None)
    if call is not None and call.active():
        call.cancel()
    channel._aap_deadline = None


def _start_deadline(channel, seconds: float, message: str) -> None:
    _cancel_deadline(channel)
    channel._aap_deadline = channel.callLater(seconds, refuse, channel, 408, message)


@implementer(IPushProducer)
class SendBuffer:
    """A response's flow control, registered with its request as a push producer: Twisted
    pauses it when the socket's buffer is full and resumes it once the client has read it."""

    def __init__(self):
        self.paused = False
        self.resumed = asyncio.Event()
        self.resumed.set()

    def pauseProducing(self) -> None:
        self.paused = True
        self.resumed.clear()

    def resumeProducing(self) -> None:
        self.paused = False
        self.resumed.set()

    def stopProducing(self) -> None:
        self.pauseProducing()


def _drop(request, waited: float) -> None:
    """Close a response whose client read nothing for `waited` seconds (Daphne then tells the
    application it disconnected)."""
    request._aap_dropped = True
    if request.producer is not None:
        request.unregisterProducer()
    logger.warning(
        "dropped a response to %s: its client read nothing for %.0f seconds",
        request.path.decode("ascii", "replace"),  # the path alone: a query may hold a ticket
        waited,
    )
    request.channel.transport.abortConnection()


def _flow_controlled_request(original):
    """Daphne's WebRequest.handle_reply: a response registers its SendBuffer with its first
    body bytes and unregisters it before its last (Twisted logs one left behind)."""

    def handle_reply(self, message):
        if getattr(self, "_aap_dropped", False):
            return None
        if message.get("type") == "http.response.body" and not self.finished and self.channel is not None:
            more = message.get("more_body", False)
            if more and self.producer is None:
                with contextlib.suppress(RuntimeError):  # the connection's previous response holds one
                    self.registerProducer(SendBuffer(), True)
            elif not more and isinstance(self.producer, SendBuffer):
                self.unregisterProducer()
        return original(self, message)

    return handle_reply


def _flow_controlled_send(original):
    """Daphne's Server.handle_reply, the application's `send`: while the client is not
    reading, a body message waits (the application waits with it: a turn's stream stops
    reading its events, which Redis keeps), for up to AAP_RESPONSE_STALL_SECONDS; then the
    response is dropped."""

    async def handle_reply(self, protocol, message):
        buffer = getattr(protocol, "producer", None)
        if isinstance(buffer, SendBuffer) and buffer.paused and message.get("type") == "http.response.body":
            try:
                async with asyncio.timeout(settings.AAP_RESPONSE_STALL_SECONDS):
                    await buffer.resumed.wait()
            except TimeoutError:
                if not getattr(protocol, "_aap_dropped", False) and protocol.channel is not None:
                    _drop(protocol, settings.AAP_RESPONSE_STALL_SECONDS)
                return None
        return await original(self, protocol, message)

    return handle_reply


def _patch(cls: type, **attributes: object) -> None:
    """Set attributes of a framework class, its methods among them (setattr: a type checker
    refuses an assignment to a method)."""
    for name, value in attributes.items():
        setattr(cls, name, value)


def install() -> None:
    """Patch Twisted's HTTP channel and Daphne's request (idempotent): the server layer's limits."""
    from daphne.http_protocol import WebRequest
    from daphne.server import Server
    from twisted.web.http import HTTPChannel

    if getattr(HTTPChannel, "_aap_limits", False):
        return
    _patch(HTTPChannel, _aap_limits=True)

    data_received = HTTPChannel.dataReceived
    all_headers_received = HTTPChannel.allHeadersReceived
    all_content_received = HTTPChannel.allContentReceived
    connection_lost = HTTPChannel.connectionLost

    def dataReceived(self, data):
        # The first byte of a request starts its clock; a request being answered has none.
        if not self._handlingRequest and getattr(self, "_aap_deadline", None) is None:
            _start_deadline(
                self,
                settings.AAP_REQUEST_HEADERS_TIMEOUT_SECONDS,
                f"The request line and headers did not arrive within {settings.AAP_REQUEST_HEADERS_TIMEOUT_SECONDS:g} seconds.",
            )
        return data_received(self, data)

    def allHeadersReceived(self):
        if self.length is not None and self.length > settings.AAP_MAX_BODY_BYTES:
            return refuse(self, 413, too_large_message())
        _start_deadline(
            self,
            settings.AAP_REQUEST_BODY_TIMEOUT_SECONDS,
            f"The request body did not arrive within {settings.AAP_REQUEST_BODY_TIMEOUT_SECONDS:g} seconds.",
        )
        return all_headers_received(self)

    def allContentReceived(self):
        _cancel_deadline(self)
        return all_content_received(self)

    def connectionLost(self, reason):
        _cancel_deadline(self)
        return connection_lost(self, reason)

    def _respondToBadRequestAndDisconnect(self):
        refuse(
            self,
            400,
            "The request is not valid HTTP (malformed line, oversized headers, or a bad Content-Length or chunk size).",
        )

    def lineLengthExceeded(self, line):
        refuse(self, 400, "The request line or a header is longer than the server accepts.")

    _patch(
        HTTPChannel,
        lineLengthExceeded=lineLengthExceeded,
        dataReceived=dataReceived,
        allHeadersReceived=allHeadersReceived,
        allContentReceived=allContentReceived,
        connectionLost=connectionLost,
        _respondToBadRequestAndDisconnect=_respondToBadRequestAndDisconnect,
    )

    handle_content_chunk = WebRequest.handleContentChunk

    def handleContentChunk(self, data):
        self._aap_received = getattr(self, "_aap_received", 0) + len(data)
        if self._aap_received > settings.AAP_MAX_BODY_BYTES:
            return refuse(self.channel, 413, too_large_message())
        return handle_content_chunk(self, data)

    def basic_error(self, status, status_text, body):
        # Daphne's own refusals (invalid header names, bad paths): JSON like every API error.
        self.handle_reply(
            {"type": "http.response.start", "status": status, "headers": [(b"Content-Type", b"application/json")]}
        )
        sentence = f"{body}." if status < 500 else "The server could not handle this request; try again."
        self.handle_reply({"type": "http.response.body", "body": json.dumps({"error": sentence}).encode()})

    _patch(
        WebRequest,
        handleContentChunk=handleContentChunk,
        basic_error=basic_error,
        handle_reply=_flow_controlled_request(WebRequest.handle_reply),
    )
    _patch(Server, handle_reply=_flow_controlled_send(Server.handle_reply))
