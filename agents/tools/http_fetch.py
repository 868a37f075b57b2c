"""Host tool http_fetch: GET an http(s) URL and return its readable text.

Settings (ServerTool.settings, all optional):
    allowPrivateAddresses  false: refuse hosts that resolve to loopback, private, link-local
                           or other non-public addresses (also after each redirect)
    maxBytes               stop reading the body after this many bytes (1 000 000)
    maxChars               cut the returned text after this many characters (20 000)
    timeoutSeconds         the whole fetch, redirects included (10)
    maxRedirects           (5)

The connection goes to the address that was checked (the host name is only sent as
`Host` and TLS server name), so a DNS answer that changes between check and connect
cannot reach a refused address. Environment proxies are not used for the same reason.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from html.parser import HTMLParser

import httpx

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
    "p", "div", "br", "li", "ul", "ol", "tr", "table", "section", "article", "header", "footer", "nav",
    "h1", "h2", "h3", "h4", "h5", "h6", "pre", "blockquote", "dt", "dd", "hr", "title", "main", "aside",
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


def is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


async def _addresses(host: str, port: int) -> list[str]:
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise ToolInputError(f"The host {host} could not be resolved.") from None
    seen: list[str] = []
    for info in infos:
        if info[4][0] not in seen:
            seen.append(info[4][0])
    if not seen:
        raise ToolInputError(f"The host {host} could not be resolved.")
    return seen


def _settings(settings: dict) -> dict:
    merged = {**DEFAULT_SETTINGS, **(settings or {})}
    for key in ("maxBytes", "maxChars", "timeoutSeconds", "maxRedirects"):
        value = merged[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            merged[key] = DEFAULT_SETTINGS[key]
    return merged


async def _fetch(url: str, opts: dict) -> str:
    async with httpx.AsyncClient(trust_env=False, follow_redirects=False, timeout=opts["timeoutSeconds"]) as client:
        for _ in range(int(opts["maxRedirects"]) + 1):
            target = httpx.URL(url)
            if target.scheme not in ("http", "https") or not target.host:
                raise ToolInputError("Only http:// and https:// URLs with a host can be fetched.")
            port = target.port or (443 if target.scheme == "https" else 80)
            addresses = await _addresses(target.host, port)
            if not opts["allowPrivateAddresses"]:
                refused = [a for a in addresses if not is_public(a)]
                if refused:
                    raise ToolInputError(
                        f"Refusing to fetch {target.host}: it resolves to a loopback, private or link-local "
                        f"address ({refused[0]}), which this tool is not allowed to reach."
                    )
            host_header = target.host if target.port is None else f"{target.host}:{target.port}"
            pinned = target.copy_with(host=addresses[0])
            extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
            async with client.stream("GET", pinned, headers={"Host": host_header, "Accept": "text/*, */*;q=0.5"},
                                     extensions=extensions) as response:
                if response.is_redirect and "location" in response.headers:
                    url = str(target.join(response.headers["location"]))
                    continue
                body, cut = bytearray(), False
                async for chunk in response.aiter_bytes():
                    body.extend(chunk)
                    if len(body) > opts["maxBytes"]:
                        del body[int(opts["maxBytes"]):]
                        cut = True
                        break
                return _render(str(target), response, bytes(body), cut, opts)
    raise ToolInputError(f"Fetching {url} redirected more than {opts['maxRedirects']} times.")


def _render(url: str, response: httpx.Response, body: bytes, cut: bool, opts: dict) -> str:
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
        httpx.URL(url)
    except httpx.InvalidURL:
        raise ToolInputError("'url' is not a valid URL.") from None
    opts = _settings(settings)
    try:
        async with asyncio.timeout(opts["timeoutSeconds"]):
            return await _fetch(url, opts)
    except (TimeoutError, httpx.TimeoutException):
        raise ToolInputError(f"Fetching {url} took longer than {opts['timeoutSeconds']:g} seconds.") from None
    except httpx.HTTPError as exc:
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
