"""The model endpoint: one pooled client per endpoint per process, the raw Chat Completions
call, the network guard for application-chosen endpoints, and safe error sentences."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
from collections import OrderedDict

import aiohttp
import httpx
import httpx2
import openai
from openai.types.chat import ChatCompletion

from ...netguard import AddressRefused, GuardedTransport, NonPublicAddress, checked_address
from ..base import AgentError, TurnContext

logger = logging.getLogger("agents.runtimes.openai")

DEFAULT_BASE_URL = "https://api.openai.com/v1"
OPENAI_HOSTS = ("api.openai.com",)  # OpenAI's own API: the only one sent `max_completion_tokens` by default
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


TOO_LONG = (
    "The conversation is too long for the model: it does not fit the model's context window even after "
    "compaction; send a shorter message or start a new session."
)
# How servers word a prompt over the context window (OpenAI, vLLM, llama.cpp, Ollama, LiteLLM, ...).
OVERFLOW_RE = re.compile(
    r"context[ _-]?(length|window|size)|maximum context|context_length_exceeded|exceeds? the (available )?context"
    r"|too many tokens|prompt is too long|n_ctx|reduce the length of the messages|input is too long",
    re.IGNORECASE,
)
KEY_RE = re.compile(r"\b(?:sk|pk|rk)-[A-Za-z0-9*._-]{4,}")  # API keys, masked ones too
NAMED_SECRET_RE = re.compile(
    r"(?i)\b(bearer|token|api[_-]?key|password|secret)([\"']?\s*[:=]\s*[\"']?|\s+)[^\s\"',}]{6,}"
)
LONG_TOKEN_RE = re.compile(r"\b[A-Za-z0-9_-]{32,}\b")  # anything that looks like a credential
PROVIDER_TEXT_LOGGED = 500  # characters of the provider's error text a log line keeps


class StreamFailed(Exception):
    """A streamed answer that cannot be trusted as complete: what happened, as a safe sentence."""

    def __init__(self, sentence: str, *, status: int | None = None, detail: str = "", overflow: bool = False):
        super().__init__(sentence)
        self.sentence = sentence
        self.status = status
        self.detail = detail
        self.overflow = overflow  # an empty answer to a prompt estimated over the context budget


class ContextOverflow(Exception):
    """The prompt did not fit the model's context window (the provider said so, or answered nothing)."""


@functools.lru_cache(maxsize=256)
def default_tokens_field(base_url: str) -> str:
    """`max_completion_tokens` for OpenAI's own API; `max_tokens` (what every compatible server
    reads, and what OpenAI still accepts for most models) for any other. Kept per base URL:
    parsing one is a few percent of a worker's CPU per turn."""
    host = httpx.URL(base_url).host or ""
    return "max_completion_tokens" if host in OPENAI_HOSTS else "max_tokens"


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """A provider's text with keys and token-like strings taken out, cut to a log line's length."""
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "[redacted]")
    text = KEY_RE.sub("[redacted]", text)
    text = NAMED_SECRET_RE.sub(lambda m: m.group(1) + m.group(2) + "[redacted]", text)
    text = LONG_TOKEN_RE.sub("[redacted]", text)
    text = " ".join(text.split())
    return text if len(text) <= PROVIDER_TEXT_LOGGED else text[:PROVIDER_TEXT_LOGGED] + "..."


def provider_text(exc: BaseException) -> str:
    """The provider's own words about a failure (its error body), unredacted: for logs only."""
    if isinstance(exc, StreamFailed):
        return exc.detail
    if isinstance(exc, openai.APIStatusError):
        body = exc.body
        if isinstance(body, dict):
            error = body.get("error", body)
            message = error.get("message") if isinstance(error, dict) else error
            return message if isinstance(message, str) else json.dumps(body)[:2000]
        try:
            return exc.response.text[:2000]
        except httpx2.StreamError:  # a streamed error body that was not read (the SDK's responses are httpx2's)
            return ""
    cause = exc.__cause__ or exc.__context__
    return f"{type(exc).__name__}" + (f" ({type(cause).__name__}: {cause})" if cause else f": {exc}")


def status_of(exc: BaseException) -> int | None:
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code
    if isinstance(exc, StreamFailed):
        return exc.status
    return None


def is_overflow(exc: BaseException) -> bool:
    """A 400/413/422/500 whose text says the prompt is over the model's context window."""
    status = status_of(exc)
    return status in (400, 413, 422, 500) and bool(OVERFLOW_RE.search(provider_text(exc)))


def log_failure(
    ctx: TurnContext, exc: BaseException, sentence: str, *, api_key: str = "", what: str = "model call"
) -> None:
    """One line per provider failure: status, the provider's own text (secrets redacted), the ids."""
    status = status_of(exc)
    logger.warning(
        "%s failed for agent %s (tenant %s, session %s, turn %s): %s status=%s provider said: %s",
        what,
        ctx.agent_name,
        ctx.tenant,
        ctx.session_id,
        ctx.turn_id,
        sentence,
        status if status is not None else "-",
        redact(provider_text(exc), (api_key,)) or "-",
        extra={"status": status, "agent": ctx.agent_name},
    )


def timed_out(exc: BaseException) -> bool:
    """The provider did not answer, or stopped sending, within the timeout.

    The SDK's aiohttp client (operator endpoints, `Clients`) reports every closed or refused
    connection as a timeout: its transport maps each `aiohttp.ClientConnectionError` to
    httpx2's `ConnectTimeout`, so a refused connection or a server that hung up arrives as
    `APITimeoutError`. The aiohttp error it was raised from says what happened
    (tests/unit/test_openai_errors.py pins that mapping)."""
    if not isinstance(exc, openai.APITimeoutError):
        return False
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, aiohttp.ClientConnectionError) and not isinstance(cause, asyncio.TimeoutError):
            return False  # refused, reset or closed: not a timeout
        cause = cause.__cause__
    return True


def safe_error(exc: BaseException, timeout: float, *, streaming: bool = False) -> str:
    """A sentence about a provider failure that is safe to show: status and kind only.

    The SDK's own messages are never used: they can carry the provider's text, which may
    quote part of the API key or the request. `streaming`: the provider had started to
    answer (a broken connection is then not a connection that could not be made).
    """
    if isinstance(exc, StreamFailed):
        return exc.sentence
    if timed_out(exc):
        if streaming:
            return f"The model provider stopped sending its answer for {timeout:g} seconds (timeout)."
        return f"The model provider did not answer within {timeout:g} seconds (timeout)."
    if isinstance(exc, openai.APIConnectionError):
        if isinstance(exc.__cause__, AddressRefused):  # a redirect or a changed DNS answer, refused by the guard
            return "The model provider's address is not a public one; an application may only choose public endpoints."
        if streaming:
            return (
                "The connection to the model provider broke while it was answering; the model's answer ended "
                "before it finished."
            )
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
        return "The model provider sent a malformed stream (data that is not JSON); the model's answer was not read."
    return "The model client could not be set up; check the agent's options."


class Clients:
    """The process's model clients, on the loop runtimes run on.

    One connection pool for operator endpoints, on aiohttp (the SDK's `DefaultAioHttpClient`:
    its C parser and asyncio-native streams cost a worker less CPU per turn than httpx2's own
    transport, docs/performance.md), and one guarded httpx2 pool for endpoints an application
    chose (every request, redirects too, checked and pinned: agents/netguard.py). The SDK
    client of an endpoint (base URL, key, timeout, retries) is built once and kept, least
    recently used first out: a turn never builds one (building one costs more than the
    request it sends).
    """

    def __init__(self):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pools: dict[bool, httpx2.AsyncClient] = {}
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
                openai.DefaultAsyncHttpxClient(transport=GuardedTransport())
                if guarded
                else openai.DefaultAioHttpClient()
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
    the SDK's type-driven transform, a cost per call that grows with the session, where the
    body built here is already plain JSON. A streamed reply's chunks come back as plain JSON
    objects too (`AsyncStream[object]`): no typed model is built per chunk. The SDK
    still does the rest: authentication, retries, timeouts, errors and the SSE framing. A body
    already encoded (bytes, Turn.chat_body) is sent as it is."""
    return await client.post(
        "/chat/completions",
        **({"content": body} if isinstance(body, bytes) else {"body": body}),
        cast_to=ChatCompletion,
        stream=stream,
        stream_cls=openai.AsyncStream[object] if stream else None,
    )
