"""Turn bodies in v2-era shape: the same stream as v3's (stream.TurnStreamHandoff), reshaped
on its way out.

A `/v2/` view marks its turn response with MARKER_HEADER (the new session's id for
`PUT /session`, `-` otherwise). V2TurnShaper, the ASGI layer outside the hand-off, strips it
and rewrites the body as it passes: an SSE stream gets `session_start` first (no `id:`, so
`Last-Event-ID` still counts the turn's events) and `tool_result` images as `{mimeType, data}`;
a JSON answer gets `sessionId` and its messages' images likewise. Keep-alives pass untouched.
"""

from __future__ import annotations

import json

from sessions_app.protocol import dumps, sse_frame

from .shapes import event_to_v2, message_to_v2

MARKER_HEADER = "X-AAP-V2-Turn"
_MARKER = MARKER_HEADER.lower().encode()


def mark(response, session_id: str | None = None):
    response[MARKER_HEADER] = session_id or "-"
    return response


class SSEShaper:
    def __init__(self, session_id: str | None):
        self.session_id = session_id
        self.buffer = b""
        self.started = False

    def feed(self, chunk: bytes, more: bool) -> bytes:
        out = b""
        if not self.started:
            self.started = True
            if self.session_id:
                out += sse_frame(None, {"event": "session_start", "sessionId": self.session_id})
        self.buffer += chunk
        *frames, self.buffer = self.buffer.split(b"\n\n")
        out += b"".join(self._frame(frame) + b"\n\n" for frame in frames)
        if not more and self.buffer:
            out, self.buffer = out + self.buffer, b""
        return out

    @staticmethod
    def _frame(frame: bytes) -> bytes:
        lines = frame.split(b"\n")
        if b"event: tool_result" not in lines:
            return frame
        head = [line for line in lines if not line.startswith(b"data: ")]
        data = b"".join(line[len(b"data: ") :] for line in lines if line.startswith(b"data: "))
        event = event_to_v2({"event": "tool_result", **json.loads(data)})
        event.pop("event")
        return b"\n".join([*head, b"data: " + dumps(event).encode()])


class JSONShaper:
    """`stream: "none"`: blanks (keep-alives) pass at once; the answer, once whole, is reshaped."""

    def __init__(self, session_id: str | None):
        self.session_id = session_id
        self.buffer = b""

    def feed(self, chunk: bytes, more: bool) -> bytes:
        out = b""
        if not self.buffer:
            stripped = chunk.lstrip()
            out, chunk = chunk[: len(chunk) - len(stripped)], stripped
        self.buffer += chunk
        if more or not self.buffer:
            return out
        body, self.buffer = self.buffer, b""
        try:
            answer = json.loads(body)
        except ValueError:
            return out + body
        if not isinstance(answer, dict) or "messages" not in answer:
            return out + body  # an error sentence
        answer["messages"] = [message_to_v2(m) for m in answer["messages"]]
        if self.session_id:
            answer = {"sessionId": self.session_id, **answer}
        return out + dumps(answer).encode()


class V2TurnShaper:
    """ASGI middleware: reshape the turn bodies of responses that carry MARKER_HEADER (the
    `/v2/` ones: hosting/asgi.py routes only those through it)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        shaper: SSEShaper | JSONShaper | None = None

        async def reshape(message):
            nonlocal shaper
            if message["type"] == "http.response.start":
                headers = message.get("headers", [])
                value = next((v for k, v in headers if k.lower() == _MARKER), None)
                if value is not None:
                    session_id = None if value == b"-" else value.decode()
                    kind = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                    shaper = SSEShaper(session_id) if kind.startswith(b"text/event-stream") else JSONShaper(session_id)
                    message = {**message, "headers": [(k, v) for k, v in headers if k.lower() != _MARKER]}
            elif message["type"] == "http.response.body" and shaper is not None:
                more = message.get("more_body", False)
                message = {**message, "body": shaper.feed(message.get("body", b""), more)}
            await send(message)

        await self.app(scope, receive, reshape)
