"""The model gateway of one agent process: its model key stays in the worker.

An agent whose runtime configuration has `gateway` never holds its model key. Its
environment gets the gateway's URL (`http://127.0.0.1:<port>/gateway/v1`, served by the
unit's egress proxy, its only way out anyway) and a random token of its own as its "API
key". The gateway checks the token (constant time), puts the real key (the session's option
value: the tenant's secret or the operator's default) in the `Authorization` header and
forwards the request to the configured endpoint (`baseUrl`). Only an OpenAI-compatible
model API goes through: `POST /chat/completions` and `GET /models[/<id>]`; anything else,
and a wrong token, is answered with a JSON error.

Every chat completion is metered: the `usage` of a JSON answer, or of the SSE chunk that
carries it (a streamed request that did not ask for it gets `stream_options.include_usage`,
and the usage-only chunk it adds is not passed on). The usage is handed to the unit's
process (`on_usage`) before the agent sees the end of the answer, so it counts for the
prompt that made the call. Streams are passed through event by event, never buffered whole.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeGuard
from urllib.parse import urlsplit

import httpx

logger = logging.getLogger("agents.runtimes.acp")

PREFIX = "/gateway/v1"
MAX_REQUEST_BYTES = 32 * 1024 * 1024  # a request with a few images as data: URIs
MAX_JSON_REPLY_BYTES = 16 * 1024 * 1024  # a JSON answer is read whole (for its usage) up to this
MAX_EVENT_BYTES = 1024 * 1024  # an SSE event longer than this is passed on unread
TIMEOUT = httpx.Timeout(connect=15.0, read=600.0, write=60.0, pool=15.0)
BODY_TIMEOUT = 60.0  # for the agent to send its request body
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "expect",
    }
)
# Never forwarded upstream: the agent's credentials (only the gateway's key goes out) and its
# choice of the key's organization or project.
CREDENTIALS = frozenset({"authorization", "x-api-key", "api-key", "cookie", "openai-organization", "openai-project"})
# Never passed back to the agent: what the answer says of the key's account.
ACCOUNT = frozenset({"set-cookie", "openai-organization", "openai-project"})
MODEL_ID = re.compile(r"[A-Za-z0-9._:@+-]+")
EVENT_END = re.compile(rb"\r?\n\r?\n")
REASONS = {400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed"}
REASONS |= {413: "Content Too Large", 502: "Bad Gateway"}


@dataclass(frozen=True)
class GatewaySpec:
    """What one unit's gateway needs: where to forward, the real key, the unit's token, and
    the environment variables that hand the agent the URL and the token."""

    base_url: str
    url_env: str
    token_env: str
    key: str = field(repr=False)
    token: str = field(repr=False)


class GatewayRefusal(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code


def display_url(url: str) -> str:
    """`url` for a log line: no credentials, no query string."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def usage_of(obj) -> tuple[int, int] | None:
    """The (prompt, completion) tokens of a chat completion or chunk, when it carries usage."""
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    if not (_is_count(prompt) and _is_count(completion)):
        return None
    return prompt, completion


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _SseMeter:
    """Passes an SSE stream on event by event, counting the last usage it carries before the
    agent sees the stream's end; drops the usage-only chunk the gateway asked for on the
    agent's behalf."""

    def __init__(self, count: Callable[[tuple[int, int]], None], drop_usage_chunk: bool):
        self.count = count
        self.drop_usage_chunk = drop_usage_chunk
        self.usage: tuple[int, int] | None = None  # seen, not counted yet
        self._buffer = b""
        self._blind = False  # an event grew past MAX_EVENT_BYTES: pass the rest on unread

    def feed(self, data: bytes) -> list[bytes]:
        """The pieces to pass on now (whole events)."""
        if self._blind:
            return [data]
        self._buffer += data
        out: list[bytes] = []
        while match := EVENT_END.search(self._buffer):
            event, self._buffer = self._buffer[: match.end()], self._buffer[match.end() :]
            if self._keep(event):
                out.append(event)
        if len(self._buffer) > MAX_EVENT_BYTES:
            out.append(self._buffer)
            self._buffer, self._blind = b"", True
        return out

    def end(self) -> bytes:
        """What is left to pass on at the end of the stream (usage counted first)."""
        self._flush()
        rest, self._buffer = self._buffer, b""
        return rest

    def _flush(self) -> None:
        if self.usage is not None:
            usage, self.usage = self.usage, None
            self.count(usage)

    def _keep(self, event: bytes) -> bool:
        lines = event.decode("utf-8", errors="replace").splitlines()
        data = "\n".join(line[5:].removeprefix(" ") for line in lines if line.startswith("data:"))
        if data.strip() == "[DONE]":
            self._flush()
            return True
        if '"usage"' not in data:
            return True
        try:
            chunk = json.loads(data)
        except ValueError:
            return True
        usage = usage_of(chunk)
        if usage is None:
            return True
        self.usage = usage  # the last one counts: a provider may repeat running totals
        return not (self.drop_usage_chunk and chunk.get("choices") == [])


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                pass
            return bytes(body)
        if len(body) + size > MAX_REQUEST_BYTES:
            raise GatewayRefusal(413, f"The request body is larger than {MAX_REQUEST_BYTES} bytes.")
        body += await reader.readexactly(size)
        await reader.readexactly(2)


class ModelGateway:
    """One unit's gateway; `serve` answers one request the egress proxy found was for it."""

    def __init__(self, spec: GatewaySpec, label: str, on_usage: Callable[[int, int], None]):
        self.spec = spec
        self.label = label
        self.on_usage = on_usage
        self._token = spec.token.encode()
        self._client: httpx.AsyncClient | None = None

    def environment(self, proxy_url: str) -> dict:
        """What the agent gets instead of the key: the gateway's URL and the unit's token."""
        return {self.spec.url_env: proxy_url + PREFIX, self.spec.token_env: self.spec.token}

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    # --- one request -----------------------------------------------------------------------

    async def serve(
        self, method: str, target: str, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Answer one request (`target` in origin form, `head` its header lines); the
        connection is closed afterwards."""
        headers = self._headers(head)
        method = method.upper()
        path = urlsplit(target).path
        try:
            body = await asyncio.wait_for(self._body(headers, reader, writer), BODY_TIMEOUT)
            self._check_token(headers, method, path)
            upstream, metered = self._route(method, target)
            if metered:
                body, added_usage = self._with_usage(body)
            else:
                added_usage = False
        except GatewayRefusal as refusal:
            await self._refuse(writer, refusal)
            return
        try:
            await self._forward(method, upstream, headers, body, writer, metered=metered, added_usage=added_usage)
        except (ConnectionError, asyncio.CancelledError):
            raise  # the agent went away, or the unit stops
        except Exception:  # the request's boundary: the agent gets a 502
            logger.warning(
                "model gateway: agent %s: %s %s failed",
                self.label,
                method,
                display_url(upstream),
                exc_info=True,
            )

    @staticmethod
    def _headers(head: bytes) -> list[tuple[str, str]]:
        headers = []
        for line in head.decode("latin-1").split("\r\n"):
            name, sep, value = line.partition(":")
            if sep and name.strip():
                headers.append((name.strip().lower(), value.strip()))
        return headers

    @staticmethod
    async def _body(headers: list[tuple[str, str]], reader: asyncio.StreamReader, writer) -> bytes:
        values = dict(headers)
        if values.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        if "chunked" in values.get("transfer-encoding", "").lower():
            return await _read_chunked(reader)
        try:
            length = int(values.get("content-length") or 0)
        except ValueError:
            raise GatewayRefusal(400, "The Content-Length header is not a number.") from None
        if length > MAX_REQUEST_BYTES:
            raise GatewayRefusal(413, f"The request body is larger than {MAX_REQUEST_BYTES} bytes.")
        return await reader.readexactly(length) if length > 0 else b""

    def _check_token(self, headers: list[tuple[str, str]], method: str, path: str) -> None:
        given = dict(headers).get("authorization", "")
        scheme, _, token = given.partition(" ")
        if not (scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._token)):
            logger.warning(
                "model gateway: agent %s sent %s %s without its gateway token; refused (401)",
                self.label,
                method,
                path[:200],
            )
            raise GatewayRefusal(401, "Use the API key this agent was given (its gateway token).", "invalid_api_key")

    def _route(self, method: str, target: str) -> tuple[str, bool]:
        """The upstream URL of an allowed request, and whether it is a metered chat completion."""
        parts = urlsplit(target)
        if not parts.path.startswith(PREFIX + "/"):
            raise GatewayRefusal(404, f"The model gateway serves {PREFIX}/chat/completions and {PREFIX}/models only.")
        rest = parts.path[len(PREFIX) :]
        metered = rest == "/chat/completions"
        segments = rest.split("/")[2:]
        models = rest.startswith("/models") and (
            rest == "/models"
            or (rest.startswith("/models/") and all(MODEL_ID.fullmatch(s) and s not in (".", "..") for s in segments))
        )
        if not (metered or models):
            raise GatewayRefusal(404, f"The model gateway serves {PREFIX}/chat/completions and {PREFIX}/models only.")
        if method != ("POST" if metered else "GET"):
            raise GatewayRefusal(405, f"{method} is not allowed on {PREFIX}{rest}.")
        url = self.spec.base_url.rstrip("/") + rest
        return (url + "?" + parts.query if parts.query else url), metered

    @staticmethod
    def _with_usage(body: bytes) -> tuple[bytes, bool]:
        """The request body, asking for usage in a stream that did not (and whether it was added)."""
        try:
            request = json.loads(body)
        except ValueError:
            raise GatewayRefusal(400, "The request body is not JSON.") from None
        if not isinstance(request, dict):
            raise GatewayRefusal(400, "The request body is not a JSON object.")
        if not request.get("stream"):
            return body, False
        options = request.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            return body, False
        request["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        return json.dumps(request, ensure_ascii=False).encode(), True

    def _upstream_headers(self, headers: list[tuple[str, str]]) -> dict:
        out = {name: value for name, value in headers if name not in HOP_BY_HOP and name not in CREDENTIALS}
        out["accept-encoding"] = "identity"  # streams pass through as they come
        if self.spec.key:
            out["authorization"] = f"Bearer {self.spec.key}"
        return out

    async def _forward(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes,
        writer: asyncio.StreamWriter,
        *,
        metered: bool,
        added_usage: bool,
    ) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=TIMEOUT, follow_redirects=False)
        request = self._client.build_request(method, url, headers=self._upstream_headers(headers), content=body)
        started = False
        try:
            response = await self._client.send(request, stream=True)
            try:
                if response.status_code >= 400:
                    logger.warning(
                        "model gateway: agent %s: %s %s answered %s",
                        self.label,
                        method,
                        display_url(url),
                        response.status_code,
                    )
                if response.status_code == 401:  # its message may quote part of the key
                    await self._refuse(writer, GatewayRefusal(502, "The model endpoint refused the gateway's key."))
                    return
                started = True
                await self._answer(response, writer, metered=metered and response.status_code < 300, added=added_usage)
            finally:
                await response.aclose()
        except httpx.HTTPError:
            logger.warning("model gateway: agent %s: %s %s failed", self.label, method, display_url(url), exc_info=True)
            if not started:
                await self._refuse(writer, GatewayRefusal(502, "The model gateway could not reach the model endpoint."))

    async def _answer(self, response: httpx.Response, writer: asyncio.StreamWriter, *, metered: bool, added: bool):
        reason = response.reason_phrase or "OK"
        head = [f"HTTP/1.1 {response.status_code} {reason}"]
        for name, value in response.headers.multi_items():
            if name.lower() not in HOP_BY_HOP and name.lower() not in ACCOUNT and name.lower() != "content-encoding":
                head.append(f"{name}: {value}")
        head += ["Transfer-Encoding: chunked", "Connection: close", "", ""]
        writer.write("\r\n".join(head).encode("latin-1", errors="replace"))
        kind = response.headers.get("content-type", "")
        if metered and kind.startswith("text/event-stream"):
            await self._stream_events(response, writer, added)
        elif metered:
            await self._json_answer(response, writer)
        else:
            async for data in response.aiter_bytes():
                await self._chunk(writer, data)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def _stream_events(self, response: httpx.Response, writer: asyncio.StreamWriter, added: bool) -> None:
        meter = _SseMeter(lambda usage: self._count(usage), drop_usage_chunk=added)
        async for data in response.aiter_bytes():
            for piece in meter.feed(data):
                await self._chunk(writer, piece)
        await self._chunk(writer, meter.end())

    async def _json_answer(self, response: httpx.Response, writer: asyncio.StreamWriter) -> None:
        data = bytearray()
        pieces = response.aiter_bytes()
        async for piece in pieces:
            data += piece
            if len(data) > MAX_JSON_REPLY_BYTES:  # too big to read: passed on, not metered
                logger.warning("model gateway: agent %s got a JSON answer too large to meter", self.label)
                await self._chunk(writer, bytes(data))
                async for more in pieces:
                    await self._chunk(writer, more)
                return
        try:
            usage = usage_of(json.loads(data))
        except ValueError:
            usage = None
        if usage is not None:
            self._count(usage)
        await self._chunk(writer, bytes(data))

    def _count(self, usage: tuple[int, int]) -> None:
        try:
            self.on_usage(*usage)
        except Exception:  # metering must never break the agent's answer
            logger.warning("model gateway: agent %s: counting usage failed", self.label, exc_info=True)

    @staticmethod
    async def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
        if data:  # an empty chunk would end the body
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()

    @staticmethod
    async def _refuse(writer: asyncio.StreamWriter, refusal: GatewayRefusal) -> None:
        error = {"message": str(refusal), "type": "invalid_request_error" if refusal.status < 500 else "gateway_error"}
        if refusal.code:
            error["code"] = refusal.code
        body = json.dumps({"error": error}).encode()
        writer.write(
            f"HTTP/1.1 {refusal.status} {REASONS.get(refusal.status, 'Error')}\r\n".encode()
            + b"Content-Type: application/json\r\nConnection: close\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
