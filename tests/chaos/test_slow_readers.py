"""Clients that stop reading: 40 re-attach to a streamed turn of 3.5 MB and never read a byte.
Each response stops writing once the client's socket is full (the stream waits, its events
stay in Redis) instead of buffering the whole turn in the web process, and is dropped after
AAP_RESPONSE_STALL_SECONDS (5 s on this stack); a client that does read afterwards gets the
whole turn, equal to history. (In `message` mode one event may hold a whole text block: a
stalled reader then holds that one event, at most AAP_TURN_MAX_OUTPUT_BYTES.)"""

from __future__ import annotations

import socket
import time

import pytest

from .faults import folded, history, new_sessions, request, rss, user

pytestmark = pytest.mark.timeout(300)

READERS = 40
WORD = "x" * 999 + " "
TEXT = WORD * 3500  # 3.5 MB: one delta per word, the answer "echo: " + TEXT


def _silent_reader(port: int, path: str, token: str) -> socket.socket:
    """A client that asks for the turn's events and reads nothing (a tiny receive window)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n".encode()
    )
    return sock


def _drain(sock: socket.socket) -> int:
    """Read what the server sent until it closed the connection: the bytes read."""
    sock.settimeout(10)
    total = 0
    try:
        while chunk := sock.recv(1 << 16):
            total += len(chunk)
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return total


def test_clients_that_do_not_read_are_dropped_and_hold_little(chaos):
    chaos.ensure_up()
    session = new_sessions(chaos, 1)[0]
    turn = request(
        chaos, "POST", f"/v1/sessions/{session}/turns", json_body={"messages": user(TEXT), "stream": "delta"}
    )
    assert turn.status == 200 and turn.stop()["stopReason"] == "end_turn", turn.raw[-300:]
    answer = folded(turn)
    assert history(chaos, session) == user(TEXT) + answer
    path = f"/v1/sessions/{session}/turns/{turn.turn_id}/events"
    whole = request(chaos, "GET", path)
    assert whole.status == 200 and folded(whole) == answer
    stream_bytes = len(whole.raw)

    web = chaos.web.pid
    log = chaos.log_dir / f"{chaos.name}-daphne.log"
    dropped_before = log.read_text(errors="replace").count("dropped a response")
    before = rss(web)
    readers = [_silent_reader(chaos.port, path, chaos.tokens["demo"]) for _ in range(READERS)]
    peak = before
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        peak = max(peak, rss(web))
        dropped = log.read_text(errors="replace").count("dropped a response") - dropped_before
        if dropped >= READERS:
            break
        time.sleep(0.2)
    growth = peak - before
    print(f"web process: {before / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB with {READERS} silent readers")
    # Buffered whole, 40 copies of the stream would be 40 x 3.5 MB of bytes alone; each reader
    # may hold one read round (events.ROUND_BYTES, parsed) and the socket's write buffer.
    assert growth < 32 * 1024 * 1024, f"the web process grew by {growth / 2**20:.0f} MiB for {READERS} silent readers"
    assert dropped == READERS, f"{dropped} of {READERS} silent readers dropped"
    received = [_drain(sock) for sock in readers]
    # Each was dropped part way: what it could still read is the kernel's buffers, not the turn.
    assert all(size < stream_bytes for size in received), (stream_bytes, received)

    # A client that reads gets the whole turn (it re-attaches like any dropped client).
    again = request(chaos, "GET", path)
    assert again.status == 200 and folded(again) == answer
