"""A worker's bell (sessions_app.engine.worker.Worker): a wake-up is never lost between threads.

The claim and the turn are replaced by stand-ins: what is checked is which thread looks,
and when. The embedded worker (`beats=False`) has no timed look, so a thread that waits
after a wake-up it missed would wait forever: each check waits on an event instead.
"""

from __future__ import annotations

import threading

import pytest

from sessions_app.engine.worker import Worker

from ..turn_checks import wait_until

PATIENCE = 10.0  # seconds a stand-in waits for what must happen; never reached when it works


class StandIns:
    """`take` hands out the turns queued here; `_run` blocks until released."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self.turns: list[str] = []
        self.looks = 0
        self.looked = threading.Condition()
        self.release = threading.Event()
        self.running = threading.Event()
        self.ran: list[str] = []
        worker.take = self.take  # type: ignore[method-assign]
        worker._run = self.run  # type: ignore[method-assign]

    def take(self):
        with self.looked:
            self.looks += 1
            self.looked.notify_all()
            return (self.turns.pop(0), None) if self.turns else None

    def run(self, turn_id, claimed) -> bool:
        self.running.set()
        assert self.release.wait(PATIENCE)
        with self.looked:
            self.ran.append(turn_id)
            self.looked.notify_all()
        return False  # no other turn was waiting when it ended, as far as it saw

    def wait_looks(self, count: int) -> None:
        with self.looked:
            assert self.looked.wait_for(lambda: self.looks >= count, PATIENCE), f"{self.looks} looks, not {count}"


def wait_idle(worker: Worker, threads: int) -> None:
    """Until `threads` of the worker's threads wait for a wake-up."""

    def idle() -> bool:
        with worker._bell:
            return worker._idle == threads

    wait_until(idle, timeout=PATIENCE, interval=0.01, message=f"{threads} threads waiting at once")


@pytest.fixture
def worker():
    worker = Worker("test", 1, beats=False)
    yield worker
    worker.stop()
    worker.drain(PATIENCE)


def test_a_wake_up_while_every_thread_is_busy_makes_the_next_free_thread_look(worker):
    stand_ins = StandIns(worker)
    stand_ins.turns.append("first")
    worker.start()
    assert stand_ins.running.wait(PATIENCE)
    # A turn is stored and its wake-up rings while the only thread runs "first"; the thread
    # will end "first" seeing nothing waiting (its look came before the turn was stored).
    stand_ins.turns.append("second")
    worker.wake()
    stand_ins.release.set()
    stand_ins.wait_looks(2)  # the look that claimed "first", then the one that claims "second"
    with stand_ins.looked:
        assert stand_ins.looked.wait_for(lambda: stand_ins.ran == ["first", "second"], PATIENCE), stand_ins.ran


def test_a_wake_up_reaches_a_waiting_thread_once(worker):
    stand_ins = StandIns(worker)
    worker.start()
    stand_ins.wait_looks(1)  # it looked, found nothing and waits
    stand_ins.turns.append("only")
    worker.wake()
    stand_ins.release.set()
    stand_ins.wait_looks(2)
    with stand_ins.looked:
        assert stand_ins.looked.wait_for(lambda: stand_ins.ran == ["only"], PATIENCE)
    # Then it waits again without another look: the wake-up was spent on the look that found
    # "only", not kept as a debt that makes a free thread look for nothing.
    wait_idle(worker, 1)
    assert stand_ins.looks == 2


def test_a_wake_up_rung_for_a_free_thread_does_not_make_a_busy_one_look_again():
    worker = Worker("test", 2, beats=False)
    stand_ins = StandIns(worker)
    stand_ins.turns.append("long")
    try:
        worker.start()
        assert stand_ins.running.wait(PATIENCE)
        stand_ins.wait_looks(2)  # one thread claimed "long", the other found nothing and waits
        # A turn is stored while one thread is free: the wake-up rings that thread, which
        # claims it; the busy thread, as it frees, has nothing to look for.
        stand_ins.turns.append("short")
        worker.wake()
        stand_ins.wait_looks(3)
        stand_ins.release.set()
        with stand_ins.looked:
            assert stand_ins.looked.wait_for(lambda: sorted(stand_ins.ran) == ["long", "short"], PATIENCE)
        wait_idle(worker, 2)
        assert stand_ins.looks == 3
    finally:
        worker.stop()
        worker.drain(PATIENCE)
