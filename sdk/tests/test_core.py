"""The SDK's core: the fold, the stream-mode shaper, SSE framing and parsing, and that importing
it pulls in no web framework. No network, no subprocess beyond the import check."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from aap.messages import MessageShaper, fold
from aap.sse import SSEParser, parse_sse, sse_frame

SDK = Path(__file__).resolve().parents[1]


def spec_fold(events: list[dict]) -> list[dict]:
    """The spec's fold, written independently of `aap.messages.fold`."""
    messages, blocks, joining = [], None, None
    for ev in events:
        kind = ev["event"]
        if kind in ("text_delta", "thinking_delta"):
            part = kind.split("_")[0]
            blocks = blocks if blocks is not None else []
            if joining == part:
                blocks[-1][part] += ev["delta"]
            else:
                blocks.append({"type": part, part: ev["delta"]})
            joining = part
        elif kind in ("text", "thinking"):
            blocks = blocks if blocks is not None else []
            blocks.append({"type": kind, kind: ev[kind]})
            joining = None
        elif kind == "tool_call":
            blocks = blocks if blocks is not None else []
            blocks.append(
                {"type": "tool_use", "toolCallId": ev["toolCallId"], "name": ev["name"], "input": ev["input"]}
            )
            joining = None
        elif kind == "tool_result":
            if blocks:
                messages.append({"role": "assistant", "content": blocks})
            blocks, joining = None, None
            messages.append({"role": "tool", "toolCallId": ev["toolCallId"], "content": ev["content"]})
    if blocks:
        messages.append({"role": "assistant", "content": blocks})
    return messages


# --- the fold --------------------------------------------------------------------------------

words = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=6)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
delta = st.builds(
    lambda kind, text: {"event": f"{kind}_delta", "delta": text}, st.sampled_from(["text", "thinking"]), words
)
tool_call = st.builds(
    lambda i, name, args: {"event": "tool_call", "toolCallId": f"call_{i}", "name": name, "input": args},
    st.integers(0, 99),
    st.sampled_from(["add", "clock", "lookup"]),
    st.dictionaries(st.text(max_size=4), json_values, max_size=3),
)
tool_result = st.builds(
    lambda i, content: {"event": "tool_result", "toolCallId": f"call_{i}", "content": content},
    st.integers(0, 99),
    st.text(max_size=8),
)
runtime_events = st.lists(st.one_of(delta, delta, delta, tool_call, tool_result), max_size=40)


def shaped(events: list[dict], mode: str) -> list[dict]:
    shaper = MessageShaper(mode)
    out = [e for event in events for e in shaper.feed(event)]
    return out + shaper.flush()


@given(runtime_events)
def test_every_stream_mode_folds_to_the_same_messages(events):
    """For any event sequence: fold(delta) == fold(message) == what stream "none" returns."""
    as_delta = fold(shaped(events, "delta"))
    as_message = fold(shaped(events, "message"))
    assert as_delta == as_message == fold(shaped(events, "none"))
    # ... and the SDK's fold agrees with the spec's fold, written independently above.
    assert as_delta == spec_fold(shaped(events, "delta"))


@given(runtime_events)
def test_message_mode_emits_one_event_per_part(events):
    out = shaped(events, "message")
    names = [e["event"] for e in out]
    assert not any(name.endswith("_delta") for name in names)
    for first, second in itertools.pairwise(out):
        assert not (first["event"] == second["event"] and first["event"] in ("text", "thinking"))


def test_fold_joins_deltas_and_splits_at_tool_results():
    events = [
        {"event": "turn_start"},
        {"event": "thinking_delta", "delta": "hm"},
        {"event": "text_delta", "delta": "a"},
        {"event": "text_delta", "delta": "b"},
        {"event": "tool_call", "toolCallId": "c1", "name": "add", "input": {"a": 1}},
        {"event": "tool_result", "toolCallId": "c1", "content": "2"},
        {"event": "text", "text": "done"},
        {"event": "turn_stop", "stopReason": "end_turn"},
    ]
    assert fold(events) == [
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hm"},
                {"type": "text", "text": "ab"},
                {"type": "tool_use", "toolCallId": "c1", "name": "add", "input": {"a": 1}},
            ],
        },
        {"role": "tool", "toolCallId": "c1", "content": "2"},
        {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
    ]


# --- SSE -------------------------------------------------------------------------------------


@given(runtime_events, st.lists(st.integers(1, 7), min_size=1, max_size=50), st.sampled_from(["\n", "\r\n", "\r"]))
def test_sse_parser_reads_any_chunking_and_line_ending(events, cuts, newline):
    frames = b"".join(sse_frame(i + 1, e) + (b": ping\n\n" if i % 3 == 0 else b"") for i, e in enumerate(events))
    frames = frames.replace(b"\n", newline.encode())
    parser, got, at = SSEParser(), [], 0
    for size in cuts * (len(frames) // max(sum(cuts), 1) + 1):
        if at >= len(frames):
            break
        got += parser.feed(frames[at : at + size])
        at += size
    got += parser.feed(frames[at:]) + parser.finish()
    assert [e.as_dict() for e in got] == events
    assert [e.id for e in got] == list(range(1, len(events) + 1))
    assert parser.pings == (len(events) + 2) // 3
    if events:
        assert parser.last_event_id == str(len(events))


def test_sse_parser_joins_multiline_data_and_keeps_partial_frames():
    parser = SSEParser()
    assert parser.feed(b'id: 7\nevent: text\ndata: {"text":\ndata: "x"}\n') == []
    [event] = parser.feed(b"\n")
    assert (event.id, event.event, event.data) == (7, "text", {"text": "x"})
    assert parse_sse(b'event: turn_stop\ndata: {"stopReason":"end_turn"}\n\n')[0].data == {"stopReason": "end_turn"}


def test_sse_frame_is_compact_json_without_the_event_key():
    frame = sse_frame(3, {"event": "text_delta", "delta": "é"})
    assert frame == 'id: 3\nevent: text_delta\ndata: {"delta":"é"}\n\n'.encode()
    assert json.loads(frame.decode().split("data: ")[1]) == {"delta": "é"}


# --- the layer itself ---------------------------------------------------------------------------


def test_aap_imports_no_web_framework():
    code = (
        "import sys, aap, aap.client, aap.cli, aap.messages, aap.sse, aap.types\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'rest_framework', 'drf_spectacular',"
        " 'channels', 'celery', 'hosting', 'agents', 'sessions_app'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=SDK, check=True, env={"PATH": ""}, timeout=60)
