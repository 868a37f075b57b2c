"""The outbound network guard: where the host may connect on behalf of an agent or a tenant.

Used by the `http_fetch` server tool and by the `openai` runtime for a base URL the
application chose. A host name is resolved, every address it resolves to must be public
(not loopback, private, link-local, multicast, reserved, nor an IPv6 form that embeds an
IPv4 address, which a NAT64 or 6to4 gateway could route to a private one), and the
connection goes to the address that was checked: the name only travels as `Host` and as
the TLS server name, so a DNS answer that changes between check and connect cannot reach a
refused address. Environment proxies are never used, for the same reason.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any

import httpx2

# IPv6 ranges whose addresses carry an IPv4 address a gateway may forward to: NAT64
# (well-known and local-use), 6to4, IPv4-compatible, IPv4-mapped, Teredo.
EMBEDDED_IPV4 = tuple(
    ipaddress.ip_network(net)
    for net in ("64:ff9b::/96", "64:ff9b:1::/48", "2002::/16", "::/96", "::ffff:0:0/96", "2001::/32")
)


class AddressRefused(Exception):
    """The destination is not allowed or cannot be resolved; the message is safe to show."""


class NonPublicAddress(AddressRefused):
    """The host resolves to an address that is not public."""

    def __init__(self, host: str, address: str, reason: str):
        self.host, self.address, self.reason = host, address, reason
        super().__init__(
            f"Refusing to connect to {host}: it resolves to {reason} ({address}); only public addresses may be "
            "reached (not loopback, private or link-local ones)."
        )


def refusal(address: str) -> str | None:
    """Why `address` (an IP literal) may not be reached, or None when it is a public address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_multicast:
        return "a multicast address"
    if isinstance(ip, ipaddress.IPv6Address) and any(ip in net for net in EMBEDDED_IPV4):
        return "an IPv6 address that embeds an IPv4 address"
    if not ip.is_global:
        return "a private or reserved address"
    return None


def is_public(address: str) -> bool:
    return refusal(address) is None


async def resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to (an IP literal resolves to itself), in resolver order."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise AddressRefused(f"The host {host} could not be resolved.") from None
    addresses: list[str] = []
    for info in infos:
        address = str(info[4][0])
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise AddressRefused(f"The host {host} could not be resolved.")
    return addresses


async def checked_address(host: str, port: int, *, allow_private: bool = False) -> str:
    """The address to connect to for `host`: every address it resolves to must be public
    (unless `allow_private`), so no resolver ordering can pick a refused one."""
    addresses = await resolve(host, port)
    if not allow_private:
        for address in addresses:
            reason = refusal(address)
            if reason:
                raise NonPublicAddress(host, address, reason)
    return addresses[0]


async def _pinned(scheme: str, host: str, port: int | None, *, allow_private: bool) -> tuple[tuple[str, str, int], str]:
    """A request's connection pool key (scheme, host name, port) and the checked address it goes to."""
    if scheme not in ("http", "https") or not host:
        raise AddressRefused("Only http:// and https:// URLs with a host can be reached.")
    port = port or (443 if scheme == "https" else 80)
    address = await checked_address(host, port, allow_private=allow_private)
    return (scheme, host, port), address


class GuardedTransport(httpx2.AsyncBaseTransport):
    """An httpx2 transport (httpx2: the httpx fork the openai and MCP SDKs build on) that checks
    and pins every request's destination (see the module).

    Each host name gets its own connection pool, so a TLS connection made for one name never
    carries a request for another name that resolves to the same address.
    """

    def __init__(self, *, allow_private: bool = False, **transport_options: Any):
        self.allow_private = allow_private
        self._options = {"trust_env": False, **transport_options}
        self._pools: dict[tuple[str, str, int], httpx2.AsyncHTTPTransport] = {}

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        url = request.url
        key, address = await _pinned(url.scheme, url.host, url.port, allow_private=self.allow_private)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = httpx2.AsyncHTTPTransport(**self._options)
        # The Host header was set from the name when the request was built; only the socket moves.
        request.url = url.copy_with(host=address)
        if url.scheme == "https":
            request.extensions = {**request.extensions, "sni_hostname": url.host}
        return await pool.handle_async_request(request)

    async def aclose(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.aclose()
