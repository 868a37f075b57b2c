"""Workers are objects: two built in one process, without Celery, share no turn. Each runs,
keeps alive, cancels and drains only the turns it claimed."""

from __future__ import annotations

import threading

import pytest

from ..turn_checks import user, wait_until


@pytest.fixture
def two_workers(monkeypatch):
    from sessions_app.engine import queue
    from sessions_app.engine.worker import Worker

    first, second = Worker("test-first", 1, beats=False), Worker("test-second", 1, beats=False)
    # Wake-ups go to the first only: the second looks for turns when it starts, then never.
    monkeypatch.setattr(queue, "wake", lambda node=None: first.wake())
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


def test_a_free_thread_finds_turns_whose_wake_up_was_lost(engine, demo, monkeypatch, settings):
    """The thread that looks for turns on a timer takes one and runs it: another free thread
    looks on the timer from then on, and finds a turn no wake-up announced."""
    from sessions_app.engine import queue
    from sessions_app.engine.worker import Worker

    settings.AAP_WORKER_POLL_SECONDS = 0.2
    monkeypatch.setattr(queue, "wake", lambda node=None: None)  # every wake-up is lost
    worker = Worker("test-looking", 2)
    worker.start()
    session, other = demo.create_session("echo"), demo.create_session("echo")
    client, answers, turns = engine.client("demo"), [], []
    try:
        for sid in (session, other):
            # 6,000 ticks 100 ms apart: each runs until it is cancelled at the end.
            turn = threading.Thread(target=lambda sid=sid: answers.append(client.turn(sid, user("/slow 6000 100"))))
            turn.start()
            turns.append(turn)
            wait_until(lambda: len(worker.liveness.tracked()) == len(turns), message=f"{len(turns)} turns found")
    finally:
        for turn_id in worker.liveness.tracked():
            worker.running.cancel(turn_id)
        for turn in turns:
            turn.join(60)
        worker.stop()
        worker.drain(timeout=60)
        client.close()
    assert [answer.body["_meta"]["cancelled"] for answer in answers] == [True, True]


def test_a_turn_found_on_the_timer_has_the_next_free_thread_look_at_once(engine, settings):
    """Wake-ups are lost in bursts: once a look on the timer finds a turn, free threads look
    one after the other until a look finds none, rather than one a timer later."""
    from sessions_app.engine.worker import Worker

    settings.AAP_WORKER_POLL_SECONDS = 0.2
    worker = Worker("test-chain", 3)
    waiting: list[str] = []
    looks, taken = [], []
    lock, release = threading.Lock(), threading.Event()

    def take():
        with lock:
            looks.append(threading.current_thread().name)
            return (waiting.pop(0), None) if waiting else None

    def run(turn_id, claimed):
        taken.append(turn_id)
        release.wait(60)
        return False

    worker.take, worker._run = take, run  # turns without PostgreSQL: only how threads look is shown
    worker.start()
    try:
        wait_until(lambda: len(looks) >= 3, message="every thread's first look")
        with lock:
            waiting.extend(["a", "b", "c"])  # no wake-up for any of them
            settings.AAP_WORKER_POLL_SECONDS = 3600.0  # a look on a timer that starts now never comes
        wait_until(lambda: len(taken) == 3, message="the three turns taken")
    finally:
        release.set()
        worker.stop()
        worker.drain(timeout=60)


def test_a_stored_turn_wakes_one_worker_not_all(engine, demo, monkeypatch, settings):
    """Two workers listen on PostgreSQL; each turn's wake-up goes to one of them (the one with
    the most free slots), so each turn costs one claim, not one per worker."""
    import psycopg

    from sessions_app.engine import queue, store
    from sessions_app.engine.worker import Worker, direct_connection_params
    from sessions_app.models import Worker as WorkerRow

    settings.AAP_WORKER_POLL_SECONDS = 3600.0  # no look on a timer: only wake-ups make a look
    monkeypatch.setattr(queue, "wake", lambda node=None: None)  # the embedded mode's own wake-up
    workers = [Worker("test-aim-first", 2), Worker("test-aim-second", 2)]
    claims: dict[str, list] = {worker.node: [] for worker in workers}

    def counted(worker):
        take = worker.take

        def counting():
            taken = take()
            claims[worker.node].append(taken and taken[0])
            return taken

        return counting

    params = direct_connection_params()

    def ready() -> bool:
        """Both listen, and both have written their heartbeat (what a wake-up is aimed by)."""
        with psycopg.connect(**params, autocommit=True) as conn:
            (listening,) = conn.execute(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() AND query = %s",
                [f'LISTEN "{store.WAKE_CHANNEL}"'],
            ).fetchone()
            (beating,) = conn.execute(
                f"SELECT COUNT(*) FROM {WorkerRow._meta.db_table} WHERE node LIKE 'test-aim-%%'"
            ).fetchone()
        return listening >= 2 and beating == 2

    for worker in workers:
        worker.take = counted(worker)  # type: ignore[method-assign]
        worker.start()
    client = engine.client("demo")
    try:
        wait_until(ready, message="both workers listening, with their heartbeats written")
        # Each worker's first looks (as it starts, and as it starts listening) are over.
        wait_until(lambda: all(w._idle == 2 and not w._look_now for w in workers), message="both workers idle")
        for worker in workers:
            claims[worker.node].clear()
        session = demo.create_session("echo")
        for number in range(6):
            result = client.turn(session, user(f"turn {number}"))
            assert result.body["stopReason"] == "end_turn", result.body
        looks = claims["test-aim-first"] + claims["test-aim-second"]
        assert len(looks) == 6 and None not in looks, claims
    finally:
        client.close()
        for worker in workers:
            worker.stop()
            worker.drain(timeout=60)


def test_a_thread_running_turns_back_to_back_keeps_its_connection(engine, demo, monkeypatch, settings):
    """Between a turn's end and its claim of the next waiting turn a slot thread keeps its
    database connection: it takes one from the pool for the first claim and one for each
    turn's end (the connection goes back while the agent runs), not two per turn."""
    from django.db.backends.base.base import BaseDatabaseWrapper

    from sessions_app.engine import queue
    from sessions_app.engine.worker import Worker
    from sessions_app.models import Turn

    settings.AAP_WORKER_POLL_SECONDS = 3600.0
    monkeypatch.setattr(queue, "wake", lambda node=None: None)  # stored turns wait for this test's worker
    worker = Worker("test-back-to-back", 1, beats=False)
    slots: set[int] = set()
    serve = worker._serve

    def serving():
        slots.add(threading.get_ident())
        serve()

    worker._serve = serving  # type: ignore[method-assign]
    connects: list[str] = []
    connect = BaseDatabaseWrapper.connect

    def counted(self):
        if threading.get_ident() in slots:
            connects.append(threading.current_thread().name)
        return connect(self)

    monkeypatch.setattr(BaseDatabaseWrapper, "connect", counted)
    sessions = [demo.create_session("echo") for _ in range(4)]
    results: dict = {}

    def send(session):
        client = engine.client("demo")
        try:
            results[session] = client.turn(session, user("hello"))
        finally:
            client.close()

    senders = [threading.Thread(target=send, args=(session,)) for session in sessions]
    for sender in senders:
        sender.start()
    mine = Turn.objects.filter(session__public_id__in=sessions)
    wait_until(lambda: mine.filter(status=Turn.QUEUED).count() == 4, message="the four turns stored")
    worker.start()
    try:
        for sender in senders:
            sender.join(60)
        assert [results[s].body["stopReason"] for s in sessions] == ["end_turn"] * 4
        assert len(connects) == 5, connects  # the first claim, then each turn's end
    finally:
        worker.stop()
        worker.drain(timeout=60)
