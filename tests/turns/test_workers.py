"""Workers are objects: two built in one process, without Celery, share no turn. Each runs,
keeps alive, cancels and drains only the turns it claimed."""

from __future__ import annotations

import threading

import pytest

from ..turn_checks import user, wait_until


@pytest.fixture
def two_workers(monkeypatch):
    from sessions_app import dispatch
    from sessions_app.worker import Worker

    first, second = Worker("test-first", 1, beats=False), Worker("test-second", 1, beats=False)
    # Wake-ups go to the first only: the second looks for turns when it starts, then never.
    monkeypatch.setattr(dispatch, "wake", lambda node=None: first.wake())
    first.start()
    second.start()
    yield first, second
    for worker in (first, second):
        worker.stop()
        worker.drain(timeout=60)


def test_a_worker_drains_only_its_own_turns(engine, demo, two_workers):
    first, second = two_workers
    assert first.histories is not second.histories
    session = demo.create_session("echo")
    answers: dict = {}
    client = engine.client("demo")
    # 600 ticks 100 ms apart: it runs until it is cancelled below.
    turn = threading.Thread(target=lambda: answers.update(result=client.turn(session, user("/slow 600 100"))))
    turn.start()
    try:
        (turn_id,) = wait_until(first.liveness.tracked, message="the first worker to run the turn")
        assert turn_id in first.running
        assert second.liveness.tracked() == [] and turn_id not in second.running

        second.stop()
        assert second.drain(timeout=60)  # it ran nothing: drained while the first's turn runs
        assert first.liveness.tracked() == [turn_id] and turn_id in first.running

        cancel = demo.post(f"/v1/sessions/{session}/turns/{turn_id}/cancel")  # the first worker hears it
        assert cancel.status_code == 202, cancel.text
        turn.join(60)
        assert answers["result"].body["_meta"]["cancelled"] is True
        wait_until(lambda: not first.liveness.tracked(), message="the first worker to let the turn go")
        assert turn_id not in first.running
        first.stop()
        assert first.drain(timeout=60)
    finally:
        turn.join(60)
        client.close()
