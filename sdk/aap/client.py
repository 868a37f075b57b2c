"""AAP clients over httpx: `Client` (sync) and `AsyncClient` (asyncio), with the same methods.

    client = Client("http://127.0.0.1:8000/v1", token)       # or AAP_URL / AAP_TOKEN
    session = client.create_session("echo")
    print(client.turn(session, "hello").messages)            # stream "none": a TurnResult
    with client.turn(session, "hello", stream="delta") as stream:
        for event in stream:                                 # typed events as they arrive
            print(event.event, event.text)

Tool helpers: a `ToolRegistry` answers client tools with Python functions, and
`converse()` runs turns until the agent stops asking for tools (client tools from the
registry, permissions for server tools from a callback). This service's extensions are typed:
`turn_id`, `events_ticket`, `usage`, `queued`, re-attach with `Last-Event-ID`, cancel, idempotency keys.

Longer than ~400 lines on purpose: the sync and async clients mirror each other method for
method, and side by side they stay in step.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import httpx

from .messages import fold, tool_uses
from .sse import SSEParser
from .types import PROTOCOL_VERSION, Event, QueuedPlace

DEFAULT_TIMEOUT = httpx.Timeout(60.0, read=300.0)


class AAPError(Exception):
    """A non-2xx answer: `status`, the server's sentence, its `details`, and `retry_after`
    (seconds) on 429 / 503."""

    def __init__(self, status: int, message: str, *, details: Any = None, retry_after: float | None = None):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.details = details
        self.retry_after = retry_after


def _error(response: httpx.Response, body: bytes) -> AAPError:
    try:
        payload = json.loads(body)
        message, details = payload.get("error") or response.reason_phrase, payload.get("details")
    except (ValueError, AttributeError):
        message, details = body.decode("utf-8", "replace")[:500] or response.reason_phrase, None
    retry = response.headers.get("Retry-After")
    return AAPError(
        response.status_code,
        message,
        details=details,
        retry_after=float(retry) if retry and retry.replace(".", "", 1).isdigit() else None,
    )


# --- results ----------------------------------------------------------------------------------


@dataclass
class TurnResult:
    """A finished turn: its stop reason, its messages (the fold of its events), and what this
    service adds (`turn_id`, `usage`, `meta` of the stop)."""

    stop_reason: str
    messages: list[dict[str, Any]]
    turn_id: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    events_ticket: str | None = None

    @property
    def usage(self) -> dict[str, Any] | None:
        return self.meta.get("usage")

    @property
    def cancelled(self) -> bool:
        return bool(self.meta.get("cancelled"))

    @property
    def text(self) -> str:
        """The assistant's text across the turn's messages (AAP allows `content` to be a plain
        string as well as blocks)."""
        return "".join(
            m["content"] if isinstance(m["content"], str) else _blocks_text(m["content"])
            for m in self.messages
            if m["role"] == "assistant"
        )

    def pending_tool_calls(self) -> list[dict[str, Any]]:
        """The turn's `tool_use` blocks that have no `tool` message yet (the application's to answer)."""
        answered = {m["toolCallId"] for m in self.messages if m["role"] == "tool"}
        return [b for m in self.messages for b in tool_uses(m) if b["toolCallId"] not in answered]


def _blocks_text(blocks: list[dict[str, Any]]) -> str:
    return "".join(block.get("text", "") for block in blocks if block.get("type") == "text")


def _json_result(response: httpx.Response, body: bytes) -> TurnResult:
    payload = json.loads(body)
    meta = payload.get("_meta") or {}
    return TurnResult(
        payload["stopReason"],
        payload["messages"],
        response.headers.get("AAP-Turn-Id") or meta.get("turnId"),
        meta,
        events_ticket=response.headers.get("AAP-Events-Ticket"),
    )


class _StreamBase:
    def __init__(self, response: httpx.Response):
        self.response = response
        self.turn_id: str | None = response.headers.get("AAP-Turn-Id")
        self.events_ticket: str | None = response.headers.get("AAP-Events-Ticket")
        self.events: list[Event] = []
        self._parser = SSEParser()
        self._done = False  # read to its end (or closed): iterating again yields nothing

    @property
    def last_event_id(self) -> str | None:
        """What to send as `Last-Event-ID` to re-attach after a broken connection."""
        return self._parser.last_event_id

    @property
    def queued(self) -> QueuedPlace | None:
        """`{"position": n}` while the turn waits for a worker (from `turn_start` and the
        `: queued` comments that follow it); None once it runs or if it never waited."""
        return self._parser.queued

    def _feed(self, chunk: bytes) -> list[Event]:
        events = self._parser.feed(chunk)
        self.events.extend(events)
        return events

    def _finish(self) -> list[Event]:
        events = self._parser.finish()
        self.events.extend(events)
        return events

    def _truncated(self) -> str:
        """Why there is no result; re-attach is named only when this server offers it (a turn
        id and event ids: an extension, not AAP)."""
        start = next((e for e in self.events if e.event == "turn_start"), None)
        turn_id = self.turn_id or (start.meta.get("turnId") if start else None)
        if turn_id and self.last_event_id is not None:
            return "The stream ended before turn_stop; re-attach with last_event_id to read the rest."
        return (
            "The stream ended before turn_stop and this server offers no re-attach; "
            "read the session's history for what the turn produced."
        )

    def _result(self) -> TurnResult:
        stop = next((e for e in reversed(self.events) if e.event == "turn_stop"), None)
        if stop is None:
            raise AAPError(0, self._truncated())
        start = next((e for e in self.events if e.event == "turn_start"), None)
        return TurnResult(
            stop.data["stopReason"],
            fold(e.as_dict() for e in self.events),
            self.turn_id or (start.meta.get("turnId") if start else None),
            stop.meta,
            list(self.events),
            self.events_ticket,
        )


class TurnStream(_StreamBase):
    """A streamed turn (or a re-attach): iterate for its events as they arrive; `result()`
    reads it to the end. Use as a context manager, or call `close()`."""

    def __iter__(self) -> Iterator[Event]:
        if self._done:
            return
        try:
            for chunk in self.response.iter_bytes():
                yield from self._feed(chunk)
            yield from self._finish()
        finally:
            self.close()

    def result(self) -> TurnResult:
        for _ in self:
            pass
        return self._result()

    def close(self) -> None:
        self._done = True
        self.response.close()

    def __enter__(self) -> TurnStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncTurnStream(_StreamBase):
    """The asyncio `TurnStream`: `async for event in stream`, `await stream.result()`."""

    async def __aiter__(self) -> AsyncIterator[Event]:
        if self._done:
            return
        try:
            async for chunk in self.response.aiter_bytes():
                for event in self._feed(chunk):
                    yield event
            for event in self._finish():
                yield event
        finally:
            await self.aclose()

    async def result(self) -> TurnResult:
        async for _ in self:
            pass
        return self._result()

    async def aclose(self) -> None:
        self._done = True
        await self.response.aclose()

    async def __aenter__(self) -> AsyncTurnStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# --- tools ------------------------------------------------------------------------------------


Permit = Callable[[dict[str, Any]], "bool | tuple[bool, str | None]"]


class ToolRegistry:
    """Client tools answered by Python functions: `@registry.tool(description, parameters)`.
    A function takes the call's `input` dict and returns a string, content blocks, or any
    JSON value (sent as JSON text); an exception becomes an error text for the agent."""

    def __init__(self) -> None:
        self._tools: dict[str, tuple[dict[str, Any], Callable[[dict[str, Any]], Any]]] = {}

    def tool(
        self,
        description: str,
        parameters: dict[str, Any] | None = None,
        *,
        name: str | None = None,
        title: str | None = None,
    ) -> Callable[[Callable[[dict[str, Any]], Any]], Callable[[dict[str, Any]], Any]]:
        def register(fn: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
            spec: dict[str, Any] = {
                "name": name or fn.__name__,
                "description": description,
                "parameters": parameters or {"type": "object", "properties": {}},
            }
            if title:
                spec["title"] = title
            self._tools[str(spec["name"])] = (spec, fn)
            return fn

        return register

    def specs(self) -> list[dict[str, Any]]:
        """The ToolSpecs to send as the session's or turn's `tools`."""
        return [spec for spec, _ in self._tools.values()]

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    def call(self, call: dict[str, Any]) -> Any:
        """The `tool` message answering one call (awaitable when the function is async)."""
        _, fn = self._tools[call["name"]]
        try:
            value = fn(call.get("input") or {})
        except Exception as exc:  # the agent gets the error, the application goes on
            return _tool_message(call, f"Error: {type(exc).__name__}: {exc}")
        if inspect.isawaitable(value):
            return _awaited_tool_message(call, value)
        return _tool_message(call, value)


async def _awaited_tool_message(call: dict[str, Any], value: Any) -> dict[str, Any]:
    try:
        return _tool_message(call, await value)
    except Exception as exc:
        return _tool_message(call, f"Error: {type(exc).__name__}: {exc}")


def _tool_message(call: dict[str, Any], value: Any) -> dict[str, Any]:
    is_blocks = isinstance(value, list) and all(isinstance(b, dict) and "type" in b for b in value)
    content = value if isinstance(value, str) or is_blocks else json.dumps(value, ensure_ascii=False)
    return {"role": "tool", "toolCallId": call["toolCallId"], "content": content}


def _permission(call: dict[str, Any], answer: Any) -> dict[str, Any]:
    granted, reason = answer if isinstance(answer, tuple) else (bool(answer), None)
    message = {"role": "tool_permission", "toolCallId": call["toolCallId"], "granted": bool(granted)}
    if reason:
        message["reason"] = reason
    return message


def _no_client_tool(call: dict[str, Any]) -> dict[str, Any]:
    return _tool_message(call, f"Error: the application has no tool named {call['name']!r}.")


# --- request building, shared by both clients ---------------------------------------------------


def _messages(message: str | dict[str, Any] | list[Any]) -> list[dict[str, Any]]:
    if isinstance(message, str):
        return [{"role": "user", "content": message}]
    return [message] if isinstance(message, dict) else list(message)


def _turn_body(
    message: str | dict[str, Any] | list[Any],
    stream: str,
    options: dict[str, Any] | None,
    server_tools: list[Any] | None,
    tools: list[Any] | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": _messages(message)}
    if stream != "none":
        body["stream"] = stream
    agent: dict[str, Any] = {}
    if options is not None:
        agent["options"] = options
    if server_tools is not None:
        agent["tools"] = server_tools
    if agent:
        body["agent"] = agent
    if tools is not None:
        body["tools"] = tools
    return body


def _session_body(
    agent: str,
    options: dict[str, Any] | None,
    server_tools: list[Any] | None,
    tools: list[Any] | None,
    messages: list[Any] | None,
) -> dict[str, Any]:
    config: dict[str, Any] = {"name": agent}
    if options:
        config["options"] = options
    if server_tools is not None:
        config["tools"] = server_tools
    body: dict[str, Any] = {"agent": config}
    if tools is not None:
        body["tools"] = tools
    if messages is not None:
        body["messages"] = messages
    return body


def _idempotency(key: str | None) -> dict[str, Any]:
    return {"Idempotency-Key": key} if key else {}


def _base_url(base_url: str | None) -> str:
    url = (base_url or os.environ.get("AAP_URL") or "").rstrip("/")
    if not url:
        raise ValueError("No AAP base URL: pass base_url (e.g. http://127.0.0.1:8000/v1) or set AAP_URL.")
    return url


def _headers(token: str | None) -> dict[str, Any]:
    token = token if token is not None else os.environ.get("AAP_TOKEN", "")
    headers = {"Accept": "application/json, text/event-stream"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _check_meta(meta: dict[str, Any]) -> dict[str, Any]:
    if meta.get("version") != PROTOCOL_VERSION:
        raise AAPError(
            0, f"The server speaks AAP version {meta.get('version')!r}; this client speaks {PROTOCOL_VERSION}."
        )
    return meta


def _answers(result: TurnResult, registry: ToolRegistry | None, permit: Permit | None) -> list[Any]:
    """The next turn's messages for a `tool_use` stop: client tools from the registry,
    permissions from `permit` (deny when there is none)."""
    out: list[Any] = []
    for call in result.pending_tool_calls():
        if registry is not None and call["name"] in registry:
            out.append(registry.call(call))
        elif permit is not None:
            out.append(_permission(call, permit(call)))
        else:
            out.append(_permission(call, (False, "The application grants no permissions.")))
    return out


# --- the clients --------------------------------------------------------------------------------


class Client:
    """A synchronous AAP client. `base_url` ends in `/v1` (default: `AAP_URL`); `token` is an
    API token (default: `AAP_TOKEN`; empty or None: anonymous, for a public `/meta`)."""

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        *,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        http: httpx.Client | None = None,
    ):
        self.base_url = _base_url(base_url)
        self.http = http or httpx.Client(timeout=timeout)
        self.headers = _headers(token)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(
        self, method: str, path: str, *, json_body: Any = None, params: Any = None, headers: Any = None
    ) -> Any:
        response = self.http.request(
            method, self.base_url + path, json=json_body, params=params, headers={**self.headers, **(headers or {})}
        )
        if response.status_code >= 400:
            raise _error(response, response.content)
        return response.json() if response.content else None

    def _stream(
        self, method: str, path: str, *, json_body: Any = None, params: Any = None, headers: Any = None
    ) -> httpx.Response:
        request = self.http.build_request(
            method, self.base_url + path, json=json_body, params=params, headers={**self.headers, **(headers or {})}
        )
        response = self.http.send(request, stream=True)
        if response.status_code >= 400 or response.status_code == 204:
            body = response.read()
            response.close()
            if response.status_code == 204:
                return response
            raise _error(response, body)
        return response

    # --- discovery and sessions ---
    def meta(self) -> dict[str, Any]:
        return _check_meta(self._request("GET", "/meta"))

    def create_session(
        self,
        agent: str,
        *,
        options: dict[str, Any] | None = None,
        server_tools: list[Any] | None = None,
        tools: list[Any] | None = None,
        messages: list[Any] | None = None,
        idempotency_key: str | None = None,
    ) -> str:
        body = _session_body(agent, options, server_tools, tools, messages)
        return cast(
            "str",
            self._request("POST", "/sessions", json_body=body, headers=_idempotency(idempotency_key))["sessionId"],
        )

    def sessions(self, *, limit: int | None = None) -> Iterator[dict[str, Any]]:
        """Every session of this tenant, newest first (pages are followed as you iterate)."""
        after = None
        while True:
            params = {k: v for k, v in (("after", after), ("limit", limit)) if v is not None}
            page = self._request("GET", "/sessions", params=params)
            yield from page["sessions"]
            after = page.get("next")
            if not after:
                return

    def session(self, session_id: str) -> dict[str, Any]:
        return cast("dict[str, Any]", self._request("GET", f"/sessions/{session_id}"))

    def delete_session(self, session_id: str) -> None:
        self._request("DELETE", f"/sessions/{session_id}")

    def history(self, session_id: str, type: str = "full") -> list[dict[str, Any]]:
        return cast(
            "list[dict[str, Any]]",
            self._request("GET", f"/sessions/{session_id}/history", params={"type": type})["history"][type],
        )

    # --- turns ---
    def turn(
        self,
        session_id: str,
        message: str | dict[str, Any] | list[Any],
        *,
        stream: str = "none",
        options: dict[str, Any] | None = None,
        server_tools: list[Any] | None = None,
        tools: list[Any] | None = None,
        idempotency_key: str | None = None,
    ) -> TurnResult | TurnStream:
        """Send a turn: a user text, one message, or a list (tool answers). `stream="none"`
        returns a TurnResult; `"delta"` / `"message"` a TurnStream of events."""
        body = _turn_body(message, stream, options, server_tools, tools)
        response = self._stream(
            "POST", f"/sessions/{session_id}/turns", json_body=body, headers=_idempotency(idempotency_key)
        )
        if stream == "none":
            try:
                return _json_result(response, response.read())
            finally:
                response.close()
        return TurnStream(response)

    def reattach(self, session_id: str, turn_id: str, last_event_id: str | int | None = None) -> TurnStream | None:
        """The turn's events after `last_event_id`, then live until `turn_stop`; None when the
        reader already has the `turn_stop` (204)."""
        headers = {"Last-Event-ID": str(last_event_id)} if last_event_id is not None else {}
        response = self._stream("GET", f"/sessions/{session_id}/turns/{turn_id}/events", headers=headers)
        return None if response.status_code == 204 else TurnStream(response)

    def cancel(self, session_id: str, turn_id: str) -> dict[str, Any]:
        return cast("dict[str, Any]", self._request("POST", f"/sessions/{session_id}/turns/{turn_id}/cancel"))

    def converse(
        self,
        session_id: str,
        message: str | dict[str, Any] | list[Any],
        *,
        registry: ToolRegistry | None = None,
        permit: Permit | None = None,
        stream: str = "delta",
        on_event: Callable[[Event], None] | None = None,
        max_turns: int = 20,
    ) -> list[TurnResult]:
        """Run turns until the agent stops asking for tools: client tools are answered by
        `registry`, server tool permissions by `permit(call)` (True / False / (granted, reason));
        `on_event` sees every event as it arrives. Returns every turn's result."""
        results: list[TurnResult] = []
        for _ in range(max_turns):
            turned = self.turn(session_id, message, stream=stream)
            if isinstance(turned, TurnResult):
                result = turned
            else:
                with turned as live:
                    for event in live:
                        if on_event:
                            on_event(event)
                    result = live._result()
            results.append(result)
            if result.stop_reason != "tool_use":
                return results
            message = _answers(result, registry, permit)
            if any(inspect.isawaitable(m) for m in message):
                raise TypeError("An async tool function needs AsyncClient.converse.")
        return results


class AsyncClient:
    """The asyncio AAP client: the same methods as `Client`, awaited."""

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        *,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        http: httpx.AsyncClient | None = None,
    ):
        self.base_url = _base_url(base_url)
        self.http = http or httpx.AsyncClient(timeout=timeout)
        self.headers = _headers(token)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(
        self, method: str, path: str, *, json_body: Any = None, params: Any = None, headers: Any = None
    ) -> Any:
        response = await self.http.request(
            method, self.base_url + path, json=json_body, params=params, headers={**self.headers, **(headers or {})}
        )
        if response.status_code >= 400:
            raise _error(response, response.content)
        return response.json() if response.content else None

    async def _stream(
        self, method: str, path: str, *, json_body: Any = None, params: Any = None, headers: Any = None
    ) -> httpx.Response:
        request = self.http.build_request(
            method, self.base_url + path, json=json_body, params=params, headers={**self.headers, **(headers or {})}
        )
        response = await self.http.send(request, stream=True)
        if response.status_code >= 400 or response.status_code == 204:
            body = await response.aread()
            await response.aclose()
            if response.status_code == 204:
                return response
            raise _error(response, body)
        return response

    async def meta(self) -> dict[str, Any]:
        return _check_meta(await self._request("GET", "/meta"))

    async def create_session(
        self,
        agent: str,
        *,
        options: dict[str, Any] | None = None,
        server_tools: list[Any] | None = None,
        tools: list[Any] | None = None,
        messages: list[Any] | None = None,
        idempotency_key: str | None = None,
    ) -> str:
        body = _session_body(agent, options, server_tools, tools, messages)
        answer = await self._request("POST", "/sessions", json_body=body, headers=_idempotency(idempotency_key))
        return cast("str", answer["sessionId"])

    async def sessions(self, *, limit: int | None = None) -> AsyncIterator[dict[str, Any]]:
        after = None
        while True:
            params = {k: v for k, v in (("after", after), ("limit", limit)) if v is not None}
            page = await self._request("GET", "/sessions", params=params)
            for session in page["sessions"]:
                yield session
            after = page.get("next")
            if not after:
                return

    async def session(self, session_id: str) -> dict[str, Any]:
        return cast("dict[str, Any]", await self._request("GET", f"/sessions/{session_id}"))

    async def delete_session(self, session_id: str) -> None:
        await self._request("DELETE", f"/sessions/{session_id}")

    async def history(self, session_id: str, type: str = "full") -> list[dict[str, Any]]:
        answer = await self._request("GET", f"/sessions/{session_id}/history", params={"type": type})
        return cast("list[dict[str, Any]]", answer["history"][type])

    async def turn(
        self,
        session_id: str,
        message: str | dict[str, Any] | list[Any],
        *,
        stream: str = "none",
        options: dict[str, Any] | None = None,
        server_tools: list[Any] | None = None,
        tools: list[Any] | None = None,
        idempotency_key: str | None = None,
    ) -> TurnResult | AsyncTurnStream:
        body = _turn_body(message, stream, options, server_tools, tools)
        response = await self._stream(
            "POST", f"/sessions/{session_id}/turns", json_body=body, headers=_idempotency(idempotency_key)
        )
        if stream == "none":
            try:
                return _json_result(response, await response.aread())
            finally:
                await response.aclose()
        return AsyncTurnStream(response)

    async def reattach(
        self, session_id: str, turn_id: str, last_event_id: str | int | None = None
    ) -> AsyncTurnStream | None:
        headers = {"Last-Event-ID": str(last_event_id)} if last_event_id is not None else {}
        response = await self._stream("GET", f"/sessions/{session_id}/turns/{turn_id}/events", headers=headers)
        return None if response.status_code == 204 else AsyncTurnStream(response)

    async def cancel(self, session_id: str, turn_id: str) -> dict[str, Any]:
        return cast("dict[str, Any]", await self._request("POST", f"/sessions/{session_id}/turns/{turn_id}/cancel"))

    async def converse(
        self,
        session_id: str,
        message: str | dict[str, Any] | list[Any],
        *,
        registry: ToolRegistry | None = None,
        permit: Permit | None = None,
        stream: str = "delta",
        on_event: Callable[[Event], Any] | None = None,
        max_turns: int = 20,
    ) -> list[TurnResult]:
        results: list[TurnResult] = []
        for _ in range(max_turns):
            turned = await self.turn(session_id, message, stream=stream)
            if isinstance(turned, TurnResult):
                result = turned
            else:
                async with turned as live:
                    async for event in live:
                        if on_event and inspect.isawaitable(seen := on_event(event)):
                            await seen
                    result = live._result()
            results.append(result)
            if result.stop_reason != "tool_use":
                return results
            message = [await m if inspect.isawaitable(m) else m for m in _answers(result, registry, permit)]
        return results
