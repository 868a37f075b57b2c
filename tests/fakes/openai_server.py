"""A scripted OpenAI-compatible Chat Completions server on 127.0.0.1 (real HTTP).

    fake = FakeOpenAI().start()            # or: with FakeOpenAI() as fake: ...
    fake.enqueue(FakeOpenAI.tool_calls([{"name": "add", "arguments": '{"a": 2, "b": 3}'}]),
                 FakeOpenAI.text("5", usage=(12, 3)))
    ... point a client at fake.url ("http://127.0.0.1:PORT/v1") ...
    fake.requests  # [{"path", "headers", "json"}, ...] of every request received
    fake.stop()

Each POST /v1/chat/completions takes the next scripted reply (FIFO); with none left it
answers the default reply (the text "ok"). Replies are answered as an SSE stream when the
request says `stream: true` (with a usage chunk when `stream_options.include_usage` is
set) and as one JSON object otherwise. `GET /v1/models` lists one model.
`disconnects` holds the index (into `requests`) of every streamed reply the client closed
before its end.

As strict as real servers where they are stricter than OpenAI: with `strict=True` an
assistant message whose `content` is null is answered 500 (llama-cpp-python's validation
error); with `report_usage=False` no usage is sent even when asked (llama-cpp-python, many
proxies); with `window=N` a prompt over about N tokens is refused as llama-cpp-python does
(400 `context_length_exceeded` when not streamed, an empty 200 stream when streamed).
Failures a real server or the network in front of it produce: `html` (200 text/html),
`garbage` (an event stream of non-JSON data), `early_end` (text, then the stream ends without
a finish reason or `[DONE]`), `cut` (the connection closed mid-body), `reset` (a TCP reset
mid-body), `empty` (a 200 stream with no chunk), `stall` (a hang) and `error` (any status).

As a process, for benchmarks (prints its URL once ready, serves until SIGTERM / Ctrl-C):

    python -m tests.fakes.openai_server --port 0 --tokens 200 --delay-ms 5

With `by_model=True` (`--by-model`) the request's model name shapes the reply when nothing
is scripted: `tokens-N-delay-M` streams N tokens M milliseconds apart, each token's text
being the time it was sent (`"1700000000.123456 "`, epoch seconds), so a client measures
how late every token reaches it; `tool-add` calls the tool `add` with a = 2, b = 3 when the
last message is the user's and mentions "add", answers `5` once the tool's result is there,
and `ok` otherwise.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import select
import signal
import socket
import struct
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

ERROR_TYPES = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("permission_error", None),
    404: ("invalid_request_error", "model_not_found"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
}


@dataclass(frozen=True)
class Reply:
    """One scripted answer; build it with the FakeOpenAI.text/tool_calls/error/stall constructors."""

    kind: str  # text | tool_calls | error | stall | html | garbage | cut | reset | empty | unstreamed
    text: str = ""
    chunks: tuple[str, ...] | None = None
    delay: float = 0.0
    reasoning: str | None = None
    reasoning_field: str = "reasoning_content"
    finish: str = "stop"
    usage: tuple[int, int] | None = None
    calls: tuple[dict, ...] = ()
    fragments: int = 3
    status: int = 200
    message: str = ""
    seconds: float = 0.0
    headers: dict = field(default_factory=dict)
    stamp: bool = False  # each text chunk is replaced by the time it is sent
    done: bool = True  # the stream ends with `data: [DONE]`


MODEL_SHAPE_RE = re.compile(r"tokens-(\d{1,6})-delay-(\d{1,6}(?:\.\d+)?)")


def reply_for_model(model: str, messages: list) -> Reply | None:
    """The reply a `by_model` server gives this model name (see the module's docstring)."""
    shape = MODEL_SHAPE_RE.fullmatch(model or "")
    if shape:
        chunks = ["t "] * max(1, int(shape.group(1)))
        return Reply(
            "text",
            text="".join(chunks),
            chunks=tuple(chunks),
            delay=float(shape.group(2)) / 1000,
            usage=(20, len(chunks)),
            stamp=True,
        )
    if model == "tool-add":
        last = messages[-1] if messages else {}
        if isinstance(last, dict) and last.get("role") == "user" and "add" in json.dumps(last.get("content")):
            return FakeOpenAI.tool_calls([{"name": "add", "arguments": '{"a": 2, "b": 3}'}], fragments=1, usage=(20, 8))
        return FakeOpenAI.text("5" if last.get("role") == "tool" else "ok", usage=(30, 1))
    return None


class _ClientGone(Exception):
    """The client closed the connection while a reply was being streamed."""


def _words(text: str) -> list[str]:
    return re.findall(r"\S+\s*|\s+", text) or [text]


def _split(text: str, parts: int) -> list[str]:
    parts = max(1, parts)
    size = max(1, -(-len(text) // parts))
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


class FakeOpenAI:
    """A fake OpenAI-compatible server served from a background thread."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        default_reply: Reply | None = None,
        record: bool = True,
        by_model: bool = False,
        strict: bool = False,
        report_usage: bool = True,
        window: int | None = None,
    ):
        self.host = host
        self.port = port
        self.default_reply = default_reply or FakeOpenAI.text("ok")
        self.record = record
        self.by_model = by_model
        self.strict = strict
        self.report_usage = report_usage
        self.window = window
        self.requests: list[dict] = []
        self.disconnects: list[int] = []
        self._queue: collections.deque[Reply] = collections.deque()
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> FakeOpenAI:
        self._stopping.clear()
        self._server = _Server((self.host, self.port), _Handler)
        self._server.fake = self
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-openai", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeOpenAI:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    # --- scripting -------------------------------------------------------------------------

    def enqueue(self, *replies: Reply) -> None:
        with self._lock:
            self._queue.extend(replies)

    def clear(self) -> None:
        """Forget scripted replies not yet used, recorded requests and disconnects."""
        with self._lock:
            self._queue.clear()
            self.requests.clear()
            self.disconnects.clear()

    def chat_requests(self) -> list[dict]:
        """The recorded POST .../chat/completions requests."""
        return [r for r in self.requests if r["path"].endswith("/chat/completions")]

    def _next(self, body: dict | None = None) -> Reply:
        with self._lock:
            if self._queue:
                return self._queue.popleft()
        if self.by_model and isinstance(body, dict):
            shaped = reply_for_model(str(body.get("model") or ""), body.get("messages") or [])
            if shaped is not None:
                return shaped
        return self.default_reply

    def _record(self, path: str, headers, body) -> int:
        with self._lock:
            if not self.record:
                return -1
            self.requests.append({"path": path, "headers": {k.lower(): v for k, v in headers.items()}, "json": body})
            return len(self.requests) - 1

    def _gone(self, index: int) -> None:
        with self._lock:
            if index >= 0:
                self.disconnects.append(index)

    # --- reply constructors ----------------------------------------------------------------

    @staticmethod
    def text(
        text: str,
        *,
        chunks: list[str] | None = None,
        delay: float = 0.0,
        reasoning: str | None = None,
        reasoning_field: str = "reasoning_content",
        finish: str = "stop",
        usage: tuple[int, int] | None = None,
    ) -> Reply:
        """Assistant text (streamed in `chunks`, by default one per word), optional reasoning first."""
        return Reply(
            "text",
            text=text,
            chunks=tuple(chunks) if chunks is not None else None,
            delay=delay,
            reasoning=reasoning,
            reasoning_field=reasoning_field,
            finish=finish,
            usage=usage,
        )

    @staticmethod
    def tool_calls(calls: list[dict], *, fragments: int = 3, usage: tuple[int, int] | None = None) -> Reply:
        """Tool calls [{"name", "arguments": "<json string>", "id"?}], arguments streamed in fragments."""
        normalized = tuple(
            {
                "id": c.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                "name": c["name"],
                "arguments": c.get("arguments", "{}"),
            }
            for c in calls
        )
        return Reply("tool_calls", calls=normalized, fragments=fragments, finish="tool_calls", usage=usage)

    @staticmethod
    def error(status: int, message: str = "Something went wrong.", *, headers: dict | None = None) -> Reply:
        """An HTTP error with an OpenAI-style body; 429 and 5xx ask for a quick retry."""
        extra = {"retry-after-ms": "20"} if status == 429 or status >= 500 else {}
        return Reply("error", status=status, message=message, headers={**extra, **(headers or {})})

    @staticmethod
    def html(page: str = "<html><body><h1>Welcome</h1>Sign in to continue.</body></html>") -> Reply:
        """200 text/html: a proxy's or a web server's page where the API should be."""
        return Reply("html", text=page)

    @staticmethod
    def garbage() -> Reply:
        """200 text/event-stream whose data is not JSON."""
        return Reply("garbage", text="<<not json>>")

    @staticmethod
    def early_end(text: str) -> Reply:
        """The text streamed, then the stream ends cleanly with no finish reason and no [DONE]."""
        return Reply("text", text=text, finish="", done=False)

    @staticmethod
    def cut(text: str) -> Reply:
        """The text streamed, then the connection is closed in the middle of the body."""
        return Reply("cut", text=text)

    @staticmethod
    def reset(text: str) -> Reply:
        """The text streamed, then the connection is reset (TCP RST) in the middle of the body."""
        return Reply("reset", text=text)

    @staticmethod
    def unstreamed(text: str, *, usage: tuple[int, int] | None = None) -> Reply:
        """The text as one JSON chat completion even when the request asked for a stream
        (servers and proxies that ignore `stream`)."""
        return Reply("unstreamed", text=text, usage=usage)

    @staticmethod
    def empty() -> Reply:
        """200 text/event-stream with no chunk at all (then [DONE])."""
        return Reply("empty")

    @staticmethod
    def stall(seconds: float) -> Reply:
        """Stream the headers and a first chunk, then go quiet for `seconds`, then finish with "ok"."""
        return Reply("stall", text="ok", seconds=seconds)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 1024  # a thousand streams may connect at once
    allow_reuse_address = True
    fake: FakeOpenAI

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)  # a client that went away is not an error here


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "FakeOpenAI/1"
    # TCP_NODELAY, as real servers (uvicorn, llama.cpp's) set it: otherwise a token written
    # while the headers are unacknowledged waits for the client's delayed ACK (40 ms).
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format, *args):
        pass

    # --- plumbing ------------------------------------------------------------------------------

    @property
    def fake(self) -> FakeOpenAI:
        return self.server.fake

    def _json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _pause(self, seconds: float) -> None:
        """Wait, noticing a client that closes the connection meanwhile."""
        deadline = time.monotonic() + seconds
        while not self.fake._stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            # A closing client makes the socket readable at once: no need to poll often.
            readable, _, _ = select.select([self.connection], [], [], min(left, 0.5))
            if readable:
                try:
                    if self.connection.recv(1, socket.MSG_PEEK) == b"":
                        raise _ClientGone
                except (ConnectionError, OSError):
                    raise _ClientGone from None
                time.sleep(min(left, 0.05))

    def _write_chunk(self, data: bytes) -> None:
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        except (ConnectionError, OSError):
            raise _ClientGone from None

    def _sse(self, obj) -> None:
        self._write_chunk(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

    # --- routes ----------------------------------------------------------------------------------

    def do_GET(self):
        path = urlsplit(self.path).path
        self.fake._record(path, self.headers, None)
        if path.rstrip("/").endswith("/models"):
            self._json(
                200,
                {"object": "list", "data": [{"id": "fake-model", "object": "model", "created": 0, "owned_by": "fake"}]},
            )
        else:
            self._json(404, {"error": {"message": f"No route {path}.", "type": "invalid_request_error"}})

    def do_POST(self):
        path = urlsplit(self.path).path
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            self.fake._record(path, self.headers, None)
            self._json(400, {"error": {"message": "The body is not JSON.", "type": "invalid_request_error"}})
            return
        index = self.fake._record(path, self.headers, body)
        if not path.rstrip("/").endswith("/chat/completions"):
            self._json(404, {"error": {"message": f"No route {path}.", "type": "invalid_request_error"}})
            return
        refusal = self._refusal(body)
        if refusal is not None:
            self._json(*refusal)
            return
        reply = self.fake._next(body)
        if self.fake.window is not None and body.get("stream") and self._over_window(body):
            reply = FakeOpenAI.empty()
        try:
            if reply.kind == "error":
                kind, code = ERROR_TYPES.get(reply.status, ("server_error" if reply.status >= 500 else "error", None))
                self._json(
                    reply.status,
                    {"error": {"message": reply.message, "type": kind, "param": None, "code": code}},
                    reply.headers,
                )
            elif body.get("stream") and reply.kind != "unstreamed":
                self._stream(reply, body)
            else:
                self._complete(reply, body)
        except _ClientGone:
            self.fake._gone(index)
            self.close_connection = True

    # --- strictness ----------------------------------------------------------------------------

    def _over_window(self, body: dict) -> bool:
        prompt = len(json.dumps(body.get("messages", []))) // 4
        return prompt + int(body.get("max_tokens") or 0) > (self.fake.window or 0)

    def _refusal(self, body: dict) -> tuple[int, dict] | None:
        """What a strict server refuses before answering: (status, body), or None."""
        messages = body.get("messages") if isinstance(body, dict) else None
        if self.fake.strict and isinstance(messages, list):
            for i, message in enumerate(messages):
                if isinstance(message, dict) and message.get("role") == "assistant" and message.get("content") is None:
                    # llama-cpp-python's answer (its pydantic validation of the message union).
                    text = f"1 validation error: messages.{i}.content: Input should be a valid string"
                    return 500, {
                        "error": {"message": text, "type": "internal_server_error", "param": None, "code": None}
                    }
        if self.fake.window is not None and not body.get("stream") and self._over_window(body):
            prompt = len(json.dumps(messages or [])) // 4
            text = (
                f"This model's maximum context length is {self.fake.window} tokens. However, you requested "
                f"{prompt} tokens. Please reduce the length of the messages or completion."
            )
            error = {"message": text, "type": "invalid_request_error", "param": "messages"}
            return 400, {"error": {**error, "code": "context_length_exceeded"}}
        return None

    # --- answers -------------------------------------------------------------------------------

    def _usage(self, reply: Reply, body: dict, output: str) -> dict:
        if reply.usage is not None:
            prompt, completion = reply.usage
        else:
            prompt = max(1, len(json.dumps(body.get("messages", []))) // 4)
            completion = max(1, len(output) // 4)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _base(self, body: dict, kind: str) -> dict:
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:20]}",
            "object": kind,
            "created": int(time.time()),
            "model": body.get("model") or "fake-model",
        }

    def _complete(self, reply: Reply, body: dict) -> None:
        if reply.kind == "stall":
            self._pause(reply.seconds)
        message: dict = {"role": "assistant", "content": None}
        if reply.kind == "tool_calls":
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in reply.calls
            ]
            output = "".join(c["arguments"] for c in reply.calls)
        else:
            message["content"] = reply.text
            if reply.reasoning is not None:
                message[reply.reasoning_field] = reply.reasoning
            output = reply.text
        answer = self._base(body, "chat.completion")
        answer["choices"] = [{"index": 0, "message": message, "finish_reason": reply.finish, "logprobs": None}]
        if self.fake.report_usage:
            answer["usage"] = self._usage(reply, body, output)
        self._json(200, answer)

    def _stream(self, reply: Reply, body: dict) -> None:
        if reply.kind == "html":
            data = reply.text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        base = self._base(body, "chat.completion.chunk")

        def chunk(delta: dict, finish: str | None = None) -> dict:
            return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

        pieces: list[dict] = []
        if reply.kind == "tool_calls":
            for i, call in enumerate(reply.calls):
                pieces.append(
                    {
                        "tool_calls": [
                            {
                                "index": i,
                                "id": call["id"],
                                "type": "function",
                                "function": {"name": call["name"], "arguments": ""},
                            }
                        ]
                    }
                )
            fragments = [_split(call["arguments"], reply.fragments) for call in reply.calls]
            # Round-robin across calls, so a client must join the fragments per index.
            for round_ in range(max((len(f) for f in fragments), default=0)):
                for i, parts in enumerate(fragments):
                    if round_ < len(parts) and parts[round_]:
                        pieces.append({"tool_calls": [{"index": i, "function": {"arguments": parts[round_]}}]})
            output = "".join(call["arguments"] for call in reply.calls)
        else:
            if reply.reasoning:
                pieces.extend({reply.reasoning_field: word} for word in _words(reply.reasoning))
            for piece in reply.chunks if reply.chunks is not None else _words(reply.text):
                pieces.append({"content": piece})
            output = reply.text

        if reply.kind == "garbage":
            self._write_chunk(b"data: " + reply.text.encode() + b"\n\n")
            self._write_chunk(b"")
            return
        if reply.kind != "empty":
            self._sse(chunk({"role": "assistant", "content": ""}))
        else:
            pieces = []
        if reply.kind in ("cut", "reset"):
            for piece in pieces:
                self._sse(chunk(piece))
            self.wfile.flush()
            if reply.kind == "reset":  # SO_LINGER 0: close() sends RST, not FIN
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            else:  # half a chunk, then FIN: the body is incomplete
                self.wfile.write(b"40\r\ndata: {")
                self.wfile.flush()
            self.close_connection = True
            self.connection.close()
            return
        if reply.kind == "stall":
            self._pause(reply.seconds)
        for piece in pieces:
            if reply.delay:
                self._pause(reply.delay)
            if reply.stamp and "content" in piece:
                piece = {"content": f"{time.time():.6f} "}
            self._sse(chunk(piece))
        if reply.finish and reply.kind != "empty":
            self._sse(chunk({}, reply.finish))
        wants_usage = (body.get("stream_options") or {}).get("include_usage") and self.fake.report_usage
        if wants_usage and reply.done and reply.kind != "empty":
            self._sse({**base, "choices": [], "usage": self._usage(reply, body, output)})
        if reply.done:
            self._sse(b"[DONE]")
        self._write_chunk(b"")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve a fake OpenAI-compatible Chat Completions API.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--tokens", type=int, default=20, help="tokens (chunks) in the default reply")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="pause between chunks, in milliseconds")
    parser.add_argument("--by-model", action="store_true", help="shape replies by the model name (see above)")
    args = parser.parse_args(argv)
    chunks = [f"t{i} " for i in range(max(1, args.tokens))]
    reply = FakeOpenAI.text("".join(chunks), chunks=chunks, delay=args.delay_ms / 1000, usage=(20, len(chunks)))
    fake = FakeOpenAI(args.host, args.port, default_reply=reply, record=False, by_model=args.by_model).start()
    done = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: done.set())
    print(fake.url, flush=True)
    done.wait()
    fake.stop()
    sys.exit(0)


if __name__ == "__main__":
    main()
