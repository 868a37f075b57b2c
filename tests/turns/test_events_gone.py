"""A finished turn whose live events are gone (past their retention here; a Redis restart or
flush in production) is still told truthfully: a reader re-attaching from the start gets the
whole stream rebuilt from history and the turn's row, and one re-attaching from a later event
gets a 404 that says where the result is (views.TurnEventsView, store.rebuilt_stream)."""

from __future__ import annotations

import pytest

from sessions_app.engine import events

from ..support import fold_events


@pytest.mark.parametrize("mode", ["delta", "message"])
def test_a_reader_from_the_start_gets_the_stream_rebuilt_from_history(demo, settings, mode):
    session = demo.create_session("echo")
    kept = demo.turn(session, text="/think it over", stream=mode)
    assert kept.status == 200, kept.raw
    # Positive control: while its events are kept, a re-attach replays them as they were.
    replayed = demo.reattach(session, kept.turn_id)
    assert [e.as_dict() for e in replayed.events] == [e.as_dict() for e in kept.events]

    settings.AAP_EVENT_RETENTION_SECONDS = 0  # the next turn's end prunes every ended stream
    gone = demo.turn(session, text="/think it over again", stream=mode)
    assert gone.status == 200, gone.raw
    demo.turn(demo.create_session("echo"), text="prune", stream=mode)
    assert events.backend().last_sync(gone.turn_id) is None  # its live events are gone

    rebuilt = demo.reattach(session, gone.turn_id)
    assert rebuilt.status == 200, rebuilt.raw
    assert rebuilt.headers["AAP-Turn-Id"] == gone.turn_id
    assert [int(e.id) for e in rebuilt.events] == list(range(1, len(rebuilt.events) + 1))
    assert rebuilt.events[0].event == "turn_start"
    assert rebuilt.events[0].data["_meta"]["turnId"] == gone.turn_id
    assert rebuilt.events[-1].data == gone.events[-1].data  # turn_stop: from the turn's row
    shown = [e.as_dict() for e in rebuilt.events if e.event not in ("turn_start", "turn_stop")]
    assert fold_events(shown) == gone.messages == demo.history(session)[-len(gone.messages) :]
    if mode == "message":  # whole blocks: the very events the live stream had
        assert [e.as_dict() for e in rebuilt.events] == [e.as_dict() for e in gone.events]

    later = demo.reattach(session, gone.turn_id, last_event_id=2)
    assert later.status == 404, later.raw
    assert f"/v1/sessions/{session}/turns/{gone.turn_id} gives its stored result" in later.body["error"]
