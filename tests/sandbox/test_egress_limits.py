"""An agent cannot exhaust the worker's file descriptors through its egress proxy: each
connection it holds costs the worker two, so one unit may hold MAX_CONNECTIONS at once and
the rest are refused at once (503), while what it holds keeps working.

`AAP_TEST_SANDBOX_OFF=1` lifts the bound, to show the test fails then.
"""

from __future__ import annotations

import asyncio
import os

from agents.runtimes.acp_bridge import egress
from agents.runtimes.acp_bridge.egress import EgressProxy

SANDBOX_OFF = os.environ.get("AAP_TEST_SANDBOX_OFF") == "1"
HELD = 300


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_connections_held_through_the_proxy_are_bounded_per_agent(monkeypatch):
    if SANDBOX_OFF:
        monkeypatch.setattr(egress, "MAX_CONNECTIONS", 10**6)

    async def scenario():
        held_upstream = []

        async def upstream(reader, writer):
            held_upstream.append(writer)
            await reader.read()

        server = await asyncio.start_server(upstream, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        proxy = EgressProxy((f"127.0.0.1:{port}",), "fd-hoarder")
        await proxy.start()
        before = open_descriptors()
        clients, answers = [], []
        try:
            for _ in range(HELD):
                reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
                writer.write(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
                await writer.drain()
                answers.append(await asyncio.wait_for(reader.readline(), 10))
                clients.append(writer)
            await asyncio.sleep(0.2)
            # The worker's side: proxy-accepted sockets and their upstream connections (the
            # test's own client sockets and the upstream server's accepted ones excluded).
            grown = open_descriptors() - before - len(clients) - len(held_upstream)
            return answers, grown
        finally:
            for writer in clients:
                writer.close()
            await proxy.close()
            server.close()

    answers, grown = asyncio.run(scenario())
    assert answers[0].startswith(b"HTTP/1.1 200")  # control: a connection through it works
    assert sum(answer.startswith(b"HTTP/1.1 200") for answer in answers) <= egress.MAX_CONNECTIONS
    assert any(answer.startswith(b"HTTP/1.1 503") for answer in answers)
    assert grown <= 2 * egress.MAX_CONNECTIONS + 8
