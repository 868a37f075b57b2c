"""The rest of a turn rebuilt from history for a follower whose live events were lost: from
wherever the follower's reader stands, the rebuilt events fold (with what it was sent) into
exactly what history keeps, in both stream modes; a shape that does not match is refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aap.messages import MessageShaper, fold
from sessions_app.engine.store import FoldCursor, _tail

_text = st.text(alphabet="ab c", min_size=1, max_size=6)
_delta = st.one_of(
    st.builds(lambda t: {"event": "text_delta", "delta": t}, _text),
    st.builds(lambda t: {"event": "thinking_delta", "delta": t}, _text),
)


@st.composite
def runtime_events(draw) -> list[dict]:
    """What a runtime emits: deltas, tool calls, each call's result some time later."""
    events: list[dict] = []
    open_calls: list[str] = []
    for i in range(draw(st.integers(1, 14))):
        choice = draw(st.integers(0, 9))
        if choice < 6:
            events.append(draw(_delta))
        elif choice < 8:
            call = f"call_{i}"
            open_calls.append(call)
            events.append({"event": "tool_call", "toolCallId": call, "name": "add", "input": {"a": i}})
        elif open_calls:
            events.append({"event": "tool_result", "toolCallId": open_calls.pop(0), "content": f"r{i}"})
    return events


def _shaped(events: list[dict], mode: str) -> list[dict]:
    shaper = MessageShaper(mode)
    out = [shaped for event in events for shaped in shaper.feed(event)]
    return out + shaper.flush()


@pytest.mark.parametrize("mode", ["delta", "message"])
@given(events=runtime_events(), data=st.data())
def test_the_rebuilt_rest_folds_into_history_from_any_point(mode, events, data):
    stream = _shaped(events, mode)
    stored = fold(stream)
    cut = data.draw(st.integers(0, len(stream)))
    cursor = FoldCursor()
    for event in stream[:cut]:
        cursor.feed(event)
    tail = _tail(cursor, stored, mode)
    assert fold(stream[:cut] + tail) == stored


def test_a_reader_shown_something_history_does_not_hold_gets_no_rebuilt_end():
    cursor = FoldCursor()
    cursor.feed({"event": "text_delta", "delta": "hello there"})
    with pytest.raises(ValueError):
        _tail(cursor, [{"role": "assistant", "content": [{"type": "text", "text": "hi"}]}], "delta")
    with pytest.raises(ValueError):
        _tail(cursor, [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hello there!"}]}], "delta")
    # Control: the same reader, against the history it was shown the start of.
    rest = _tail(cursor, [{"role": "assistant", "content": [{"type": "text", "text": "hello there!"}]}], "delta")
    assert rest == [{"event": "text_delta", "delta": "!"}]
