"""Host tool http_fetch: GET an http(s) URL and return its readable text.

Settings (ServerTool.settings, all optional):
    allowPrivateAddresses  false: refuse hosts that resolve to loopback, private, link-local
                           or other non-public addresses (also after each redirect)
    maxBytes               stop reading the body after this many bytes, decoded (1 000 000)
    maxChars               cut the returned text after this many characters (20 000)
    timeoutSeconds         the whole fetch, redirects included (10)
    maxRedirects           (5)

Destinations go through agents.netguard (resolved, checked, pinned to the checked
address). A compressed body is decoded one layer at most, and never past maxBytes.
"""

from __future__ import annotations

import asyncio
import re
import zlib
from html.parser import HTMLParser

import httpx2

from ..netguard import AddressRefused, GuardedTransport, NonPublicAddress
from . import HostTool, ToolInputError, register

DEFAULT_SETTINGS = {
    "allowPrivateAddresses": False,
    "maxBytes": 1_000_000,
    "maxChars": 20_000,
    "timeoutSeconds": 10,
    "maxRedirects": 5,
}
TEXT_TYPES = re.compile(r"^(text/|application/(json|xml|xhtml\+xml|javascript|ld\+json|[\w.+-]*\+(json|xml)))")
BLOCK_TAGS = {
    "p",
    "div",
    "br",
    "li",
    "ul",
    "ol",
    "tr",
    "table",
    "section",
    "article",
    "header",
    "footer",
    "nav",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "pre",
    "blockquote",
    "dt",
    "dd",
    "hr",
    "title",
    "main",
    "aside",
}
SKIPPED_TAGS = {"script", "style", "noscript", "template", "svg", "iframe", "object", "canvas"}


class _Readable(HTMLParser):
    """The visible text of an HTML page, one line per block."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skipping = 0

    def handle_starttag(self, tag, attrs):
        if tag in SKIPPED_TAGS:
            self.skipping += 1
        elif tag in BLOCK_TAGS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in SKIPPED_TAGS:
            self.skipping = max(0, self.skipping - 1)
        elif tag in BLOCK_TAGS:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.skipping:
            self.parts.append(data)

    def text(self) -> str:
        lines = (re.sub(r"[ \t\r\f\v]+", " ", line).strip() for line in "".join(self.parts).split("\n"))
        return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def readable_text(body: str, content_type: str) -> str:
    if "html" in content_type:
        parser = _Readable()
        parser.feed(body)
        parser.close()
        return parser.text()
    return body.strip()


def _settings(settings: dict) -> dict:
    merged = {**DEFAULT_SETTINGS, **(settings or {})}
    for key in ("maxBytes", "maxChars", "timeoutSeconds", "maxRedirects"):
        value = merged[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            merged[key] = DEFAULT_SETTINGS[key]
    return merged


# Encodings the tool asks for and decodes itself, one layer at most (a stack of them is how a
# 1 KB "gzip, gzip" answer inflates to a gigabyte).
ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


async def _read_body(response: httpx2.Response, limit: int) -> tuple[bytes, bool]:
    """At most `limit` bytes of the decoded body (and whether it was cut), never inflating more."""
    codings = [c.strip().lower() for c in response.headers.get("content-encoding", "").split(",") if c.strip()]
    codings = [c for c in codings if c != "identity"]
    if len(codings) > 1 or (codings and codings[0] not in ENCODINGS):
        raise ToolInputError(
            f"The server answered with Content-Encoding '{', '.join(codings)}', which this tool does not decode."
        )
    inflater = zlib.decompressobj(ENCODINGS[codings[0]]) if codings else None
    body = bytearray()
    async for chunk in response.aiter_raw():
        if inflater is not None:
            try:
                # max_length bounds what one chunk may inflate to; the rest is never produced.
                chunk = inflater.decompress(chunk, limit + 1 - len(body))
            except zlib.error:
                raise ToolInputError("The server sent a compressed body that could not be decoded.") from None
        body.extend(chunk)
        if len(body) > limit:
            return bytes(body[:limit]), True
    return bytes(body), False


async def _fetch(url: str, opts: dict) -> str:
    transport = GuardedTransport(allow_private=bool(opts["allowPrivateAddresses"]))
    async with httpx2.AsyncClient(
        transport=transport, trust_env=False, follow_redirects=False, timeout=opts["timeoutSeconds"]
    ) as client:
        for _ in range(int(opts["maxRedirects"]) + 1):
            target = httpx2.URL(url)
            if target.scheme not in ("http", "https") or not target.host:
                raise ToolInputError("Only http:// and https:// URLs with a host can be fetched.")
            headers = {"Accept": "text/*, */*;q=0.5", "Accept-Encoding": ", ".join(("gzip", "deflate"))}
            async with client.stream("GET", target, headers=headers) as response:
                if response.is_redirect and "location" in response.headers:
                    url = str(target.join(response.headers["location"]))
                    continue
                body, cut = await _read_body(response, int(opts["maxBytes"]))
                return _render(str(target), response, body, cut, opts)
    raise ToolInputError(f"Fetching {url} redirected more than {opts['maxRedirects']} times.")


def _render(url: str, response: httpx2.Response, body: bytes, cut: bool, opts: dict) -> str:
    content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    head = f"HTTP {response.status_code} {response.reason_phrase} from {url} ({content_type or 'no content type'})"
    if content_type and not TEXT_TYPES.match(content_type):
        return f"{head}: {len(body)} bytes that are not text; nothing to show."
    text = readable_text(body.decode(response.encoding or "utf-8", errors="replace"), content_type)
    notes = []
    if cut:
        notes.append(f"[the body was cut at {opts['maxBytes']} bytes]")
    if len(text) > opts["maxChars"]:
        text = text[: int(opts["maxChars"])]
        notes.append(f"[the text was cut at {opts['maxChars']} characters]")
    return "\n".join([head, "", text, *notes]).rstrip()


async def _http_fetch(arguments: dict, settings: dict) -> str:
    url = arguments.get("url")
    if not isinstance(url, str) or not url.strip():
        raise ToolInputError("'url' must be an http:// or https:// URL.")
    url = url.strip()
    try:
        httpx2.URL(url)
    except httpx2.InvalidURL:
        raise ToolInputError("'url' is not a valid URL.") from None
    opts = _settings(settings)
    try:
        async with asyncio.timeout(opts["timeoutSeconds"]):
            return await _fetch(url, opts)
    except NonPublicAddress as exc:
        raise ToolInputError(
            f"Refusing to fetch {exc.host}: it resolves to {exc.reason} ({exc.address}), which this tool is not "
            "allowed to reach (loopback, private or link-local addresses are refused)."
        ) from None
    except AddressRefused as exc:
        raise ToolInputError(str(exc)) from None
    except (TimeoutError, httpx2.TimeoutException):
        raise ToolInputError(f"Fetching {url} took longer than {opts['timeoutSeconds']:g} seconds.") from None
    except httpx2.HTTPError as exc:
        raise ToolInputError(f"Fetching {url} failed ({type(exc).__name__}).") from None


register(
    HostTool(
        name="http_fetch",
        title="Fetch a web page",
        description="GETs an http(s) URL and returns its readable text (size and time limited).",
        parameters={
            "type": "object",
            "properties": {"url": {"type": "string", "description": "The http:// or https:// URL to fetch."}},
            "required": ["url"],
            "additionalProperties": False,
        },
        run=_http_fetch,
        settings=dict(DEFAULT_SETTINGS),
    )
)
