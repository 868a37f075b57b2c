"""The Python client's reading of a turn: its text, and what it says when a stream breaks."""

from __future__ import annotations

import httpx
import pytest

from aap.client import AAPError, TurnResult, TurnStream


def test_text_reads_string_content_and_text_blocks_of_assistant_messages():
    result = TurnResult(
        "end_turn",
        [
            {"role": "assistant", "content": "plain, "},
            {"role": "tool", "toolCallId": "c1", "content": "not the assistant's"},
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "hm"}, {"type": "text", "text": "blocks"}],
            },
        ],
    )
    assert result.text == "plain, blocks"


def _stream(body: bytes, **headers: str) -> TurnStream:
    return TurnStream(httpx.Response(200, headers={"Content-Type": "text/event-stream", **headers}, content=body))


def test_a_broken_stream_of_a_server_with_re_attach_says_to_re_attach():
    stream = _stream(b'id: 1\nevent: turn_start\ndata: {"_meta":{"turnId":"turn_1"}}\n\n', **{"AAP-Turn-Id": "turn_1"})
    with pytest.raises(AAPError, match="re-attach with last_event_id"):
        stream.result()


@pytest.mark.parametrize(
    "body",
    [
        b'event: turn_start\ndata: {}\n\nevent: text_delta\ndata: {"delta":"hi"}\n\n',  # no ids, no turn id
        b"id: 1\nevent: turn_start\ndata: {}\n\n",  # ids, but no turn to re-attach to
    ],
)
def test_a_broken_stream_of_a_server_without_re_attach_does_not_promise_it(body):
    with pytest.raises(AAPError) as raised:
        _stream(body).result()
    assert "offers no re-attach" in str(raised.value)
    assert "last_event_id" not in str(raised.value)
