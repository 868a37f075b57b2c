"""The model endpoint: one pooled client per endpoint per process, the raw Chat Completions
call, the network guard for application-chosen endpoints, and safe error sentences."""

from __future__ import annotations

import asyncio
import importlib
from collections import OrderedDict

import httpx
import openai
from openai.types.chat import ChatCompletion

from ...netguard import AddressRefused, GuardedTransport, NonPublicAddress, checked_address
from ..base import AgentError, TurnContext

DEFAULT_BASE_URL = "https://api.openai.com/v1"
# Sent when the application chose its own base URL without a key: the operator's key never goes there.
NO_KEY = "unused"
CLIENTS_KEPT = 64  # SDK clients kept per process (one per endpoint, key, timeout and retries)

STATUS_KINDS = {
    400: "bad request",
    401: "authentication failed; check the API key",
    403: "permission denied",
    404: "not found; check the model name and the base URL",
    408: "request timeout",
    409: "conflict",
    413: "request too large",
    422: "unprocessable request",
    429: "rate limited; retries did not help",
}


def safe_error(exc: BaseException, timeout: float) -> str:
    """A sentence about a provider failure that is safe to show: status and kind only.

    The SDK's own messages are never used: they can carry the provider's text, which may
    quote part of the API key or the request.
    """
    if isinstance(exc, openai.APITimeoutError):
        return f"The model provider did not answer within {timeout:g} seconds (timeout)."
    if isinstance(exc, openai.APIConnectionError):
        if isinstance(exc.__cause__, AddressRefused):  # a redirect or a changed DNS answer, refused by the guard
            return "The model provider's address is not a public one; an application may only choose public endpoints."
        return "Could not connect to the model provider (connection error); check the base URL."
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        kind = STATUS_KINDS.get(status) or ("server error" if status >= 500 else "error")
        return f"The model provider answered {status} ({kind})."
    if isinstance(exc, openai.APIResponseValidationError):
        return "The model provider sent a response that could not be read."
    if isinstance(exc, openai.APIError):
        return "The model provider reported an error while answering."
    if isinstance(exc, ValueError):
        return "The model provider sent a malformed stream."
    return "The model client could not be set up; check the agent's options."


def sdk_http():
    """The httpx package the openai SDK builds its clients on (its own fork in recent releases)."""
    return importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0])


class Clients:
    """The process's model clients, on the loop runtimes run on.

    One httpx connection pool for operator endpoints and one guarded pool for endpoints an
    application chose (every request, redirects too, checked and pinned). The SDK client of
    an endpoint (base URL, key, timeout, retries) is built once and kept, least recently
    used first out: building one per turn cost more CPU than the request it sends.
    """

    def __init__(self):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pools: dict[bool, httpx.AsyncClient] = {}
        self._clients: OrderedDict[tuple, openai.AsyncOpenAI] = OrderedDict()

    def get(
        self, *, api_key: str, base_url: str, timeout: float, retries: int, guarded: bool = False
    ) -> openai.AsyncOpenAI:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new loop (a forked process, a test's loop): nothing carries over
            self._loop, self._pools, self._clients = loop, {}, OrderedDict()
        key = (base_url, api_key, timeout, retries, guarded)
        client = self._clients.get(key)
        if client is not None:
            self._clients.move_to_end(key)
            return client
        pool = self._pools.get(guarded)
        if pool is None:
            pool = (
                openai.DefaultAsyncHttpxClient(transport=GuardedTransport(http=sdk_http()))
                if guarded
                else openai.DefaultAsyncHttpxClient()
            )
            self._pools[guarded] = pool
        client = openai.AsyncOpenAI(
            api_key=api_key, base_url=base_url, timeout=timeout, max_retries=retries, http_client=pool
        )
        self._clients[key] = client
        while len(self._clients) > CLIENTS_KEPT:
            self._clients.popitem(last=False)  # the pool is shared: nothing to close
        return client


def application_chosen(ctx: TurnContext, base_url: str) -> bool:
    """The application set this base URL (not the operator) and the operator did not allow it:
    it goes through the network guard."""
    if "baseUrl" not in ctx.options_set:
        return False
    url = base_url.rstrip("/")
    for allowed in ctx.config.get("allowedBaseUrls") or []:
        allowed = str(allowed).rstrip("/")
        if allowed and (url == allowed or url.startswith(allowed + "/")):
            return False
    return True


async def check_endpoint(base_url) -> None:
    """Refuse, before any call, a chosen base URL whose host is not public (no retries, a clear sentence)."""
    url = httpx.URL(str(base_url))
    try:
        await checked_address(url.host, url.port or (443 if url.scheme == "https" else 80))
    except NonPublicAddress as exc:
        raise AgentError(
            f"The base URL's host {exc.host} is {exc.reason}, not a public address; an application may only "
            "choose public endpoints (the operator can allow others in the agent's allowedBaseUrls)."
        ) from None
    except AddressRefused as exc:
        raise AgentError(str(exc)) from None


async def chat_completion(client: openai.AsyncOpenAI, body: dict | bytes, *, stream: bool):
    """POST /chat/completions with `body` sent as it is (the SDK's documented `post` for raw
    requests). `chat.completions.create()` first walks every message of the history through
    the SDK's type-driven transform: milliseconds per call that grow with the session (43 ms at
    400 messages), where the body built here is already plain JSON. A streamed reply's chunks
    come back as plain JSON objects too (`AsyncStream[object]`): building the SDK's typed
    model of every chunk was the largest part of a short turn's CPU in the runtime. The SDK
    still does the rest: authentication, retries, timeouts, errors and the SSE framing. A body
    already encoded (bytes, Turn.chat_body) is sent as it is."""
    return await client.post(
        "/chat/completions",
        **({"content": body} if isinstance(body, bytes) else {"body": body}),
        cast_to=ChatCompletion,
        stream=stream,
        stream_cls=openai.AsyncStream[object] if stream else None,
    )
