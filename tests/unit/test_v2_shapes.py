"""The v2-era shapes at the edge: translation both ways, and the reshaping of turn bodies as
they pass (SSE frames and JSON answers arriving in chunks of any size)."""

from __future__ import annotations

import json

import pytest

from sessions_app.api.v2.shapes import message_to_v2, message_to_v3, tool_to_v2, tool_to_v3
from sessions_app.api.v2.stream import JSONShaper, SSEShaper
from tests.support import parse_sse

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
V2_IMAGE = {"type": "image", "mimeType": "image/png", "data": PNG}
V3_IMAGE = {"type": "image", "url": f"data:image/png;base64,{PNG}"}


def test_an_image_round_trips_between_the_two_shapes():
    v2 = {
        "role": "tool",
        "toolCallId": "c1",
        "content": [{"type": "text", "text": "t"}, {**V2_IMAGE, "_meta": {"a": 1}}],
    }
    v3 = message_to_v3(v2)
    assert v3["content"][1] == {**V3_IMAGE, "_meta": {"a": 1}}
    assert message_to_v2(v3) == v2


def test_string_content_and_messages_without_content_pass_unchanged():
    for message in (
        {"role": "user", "content": "hi"},
        {"role": "tool_permission", "toolCallId": "c1", "granted": True},
    ):
        assert message_to_v3(message) == message == message_to_v2(message)


def test_a_tool_spec_renames_its_schema_in_place():
    v2 = {"name": "t", "title": "T", "description": "d", "inputSchema": {"type": "object"}, "_meta": {}}
    v3 = tool_to_v3(v2)
    assert list(v3) == ["name", "title", "description", "parameters", "_meta"]
    assert tool_to_v2(v3) == v2


def _chunks(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)] or [b""]


def _shaped(shaper, chunks: list[bytes]) -> bytes:
    out = shaper.feed(b"", True)  # the hand-off's empty first chunk
    for chunk in chunks:
        out += shaper.feed(chunk, True)
    return out + shaper.feed(b"", False)


V3_STREAM = (
    b'id: 1\nevent: turn_start\ndata: {"_meta":{"turnId":"turn_1"}}\n\n'
    b": ping\n\n"
    b'id: 2\nevent: tool_call\ndata: {"toolCallId":"c1","name":"shot","input":{}}\n\n'
    + b"id: 3\nevent: tool_result\ndata: "
    + json.dumps({"toolCallId": "c1", "content": [V3_IMAGE]}).encode()
    + b'\n\nid: 4\nevent: turn_stop\ndata: {"stopReason":"end_turn"}\n\n'
)


@pytest.mark.parametrize("size", [1, 7, 64, 10_000])
def test_a_put_stream_starts_with_session_start_and_shows_result_images_as_mime_type_and_data(size):
    events, pings = parse_sse(_shaped(SSEShaper("sess_1"), _chunks(V3_STREAM, size)))
    assert [(e.id, e.event) for e in events] == [
        (None, "session_start"),
        ("1", "turn_start"),
        ("2", "tool_call"),
        ("3", "tool_result"),
        ("4", "turn_stop"),
    ]
    assert events[0].data == {"sessionId": "sess_1"}
    assert events[3].data == {"toolCallId": "c1", "content": [V2_IMAGE]}
    assert pings == 1


def test_a_turn_stream_has_no_session_start_and_passes_other_frames_byte_for_byte():
    plain = V3_STREAM.replace(b"id: 3", b"id: 9")  # any frame but tool_result is untouched
    out = _shaped(SSEShaper(None), [plain])
    assert out.split(b"\n\n")[0] == plain.split(b"\n\n")[0]
    assert next(e.event for e in parse_sse(out)[0]) == "turn_start"


@pytest.mark.parametrize("size", [1, 5, 10_000])
def test_a_json_answer_keeps_its_keep_alive_blanks_and_gains_the_session_id(size):
    answer = {
        "stopReason": "end_turn",
        "messages": [{"role": "tool", "toolCallId": "c1", "content": [V3_IMAGE]}],
        "_meta": {"turnId": "turn_1"},
    }
    shaper = JSONShaper("sess_1")
    first = shaper.feed(b"", True) + shaper.feed(b" ", True) + shaper.feed(b" ", True)
    assert first == b"  "  # keep-alives go out at once
    out = first + _shaped(shaper, _chunks(json.dumps(answer).encode(), size))
    body = json.loads(out)
    assert list(body) == ["sessionId", "stopReason", "messages", "_meta"]
    assert body["sessionId"] == "sess_1"
    assert body["messages"][0]["content"] == [V2_IMAGE]


def test_a_json_error_passes_unchanged():
    error = b'{"error":"The API token of this stream was revoked or expired."}'
    assert _shaped(JSONShaper("sess_1"), [error]) == error
