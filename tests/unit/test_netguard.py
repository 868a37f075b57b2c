"""The network guard's address rules (no I/O beyond resolving IP literals)."""

from __future__ import annotations

import asyncio

import pytest

from agents.netguard import NonPublicAddress, checked_address, refusal

REFUSED = {
    "127.0.0.1": "loopback",
    "::1": "loopback",
    "10.1.2.3": "private",
    "192.168.0.10": "private",
    "172.16.5.4": "private",
    "100.64.0.1": "private",  # carrier-grade NAT
    "169.254.169.254": "link-local",  # cloud metadata
    "fe80::1": "link-local",
    "fc00::1": "private",
    "0.0.0.0": "private",
    "224.0.0.1": "multicast",
    "64:ff9b::7f00:1": "embeds an IPv4",  # NAT64 of 127.0.0.1
    "64:ff9b::808:808": "embeds an IPv4",  # NAT64 of a public address: still refused
    "64:ff9b:1::a00:1": "embeds an IPv4",  # local-use NAT64
    "2002:7f00:1::": "embeds an IPv4",  # 6to4 of 127.0.0.1
    "::127.0.0.1": "embeds an IPv4",  # IPv4-compatible
    "::a9fe:a9fe": "embeds an IPv4",  # ::169.254.169.254
    "::ffff:127.0.0.1": "embeds an IPv4",  # IPv4-mapped
    "2001:0:4136:e378:8000:63bf:3fff:fdd2": "embeds an IPv4",  # Teredo
}


@pytest.mark.parametrize("address, kind", REFUSED.items())
def test_non_public_addresses_are_refused(address, kind):
    reason = refusal(address)
    assert reason is not None and kind in reason, (address, reason)


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "2a00:1450:4007:80e::200e"])
def test_public_addresses_pass(address):
    assert refusal(address) is None


def test_checked_address_refuses_an_ip_literal_host_and_allows_it_when_told():
    with pytest.raises(NonPublicAddress) as refused:
        asyncio.run(checked_address("127.0.0.1", 80))
    assert refused.value.reason == "a loopback address" and "127.0.0.1" in str(refused.value)
    assert asyncio.run(checked_address("127.0.0.1", 80, allow_private=True)) == "127.0.0.1"
