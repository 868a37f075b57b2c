"""A worker reads and parses only the compacted rows a session gained since its last turn
there: turn 1,000 of a session costs the statements and the parsing turn 10 costs, and what
it gets is what reading the whole history again gives (also after a compaction)."""

from __future__ import annotations

import uuid

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext

from agents.runtimes.base import Compaction
from sessions_app.api.services.sessions import session_create
from sessions_app.engine import store
from sessions_app.engine.store import apply_compaction
from sessions_app.engine.worker import KeptHistories
from sessions_app.models import Message, Session
from tenancy.models import Tenant

pytestmark = pytest.mark.django_db


@pytest.fixture
def session_pk():
    call_command("seed_demo", stdout=open("/dev/null", "w"))
    created = session_create(
        tenant=Tenant.objects.get(name="demo"), agent_config={"name": "echo"}, messages=None, tools=None
    )
    return Session.objects.get(public_id=created.public_id).pk


def load(kept: KeptHistories, session_pk: int, turn_id: str) -> tuple[list[tuple[int, dict]], list[dict]]:
    """The history as (seq, message) pairs, and the turn's messages."""
    seqs, messages, incoming = kept.load(session_pk, turn_id)
    return list(zip(seqs, messages)), incoming


class Session_:
    """Appends turns the way the turn path stores them: the user's message with its turn id, then the answer."""

    def __init__(self, pk: int):
        self.pk, self.seq = pk, 0

    def start_turn(self, text: str) -> str:
        turn_id = "turn_" + uuid.uuid4().hex
        self.seq += 1
        store.start_turn(
            turn_id,
            self.pk,
            "none",
            [],
            first_seq=self.seq,
            messages=[{"role": "user", "content": text}],
            session_fields={},
        )
        return turn_id

    def answer(self, text: str) -> None:
        self.seq += 1
        store.insert_messages(self.pk, self.seq, [{"role": "assistant", "content": text}])


def test_turn_1000_reads_and_parses_what_turn_10_does(session_pk):
    kept, session = KeptHistories(), Session_(session_pk)
    work = {}
    for number in range(1, 1001):
        turn_id = session.start_turn(f"question {number}")
        with CaptureQueriesContext(connection) as queries:
            rows, incoming = load(kept, session_pk, turn_id)
        work[number] = (len(queries), kept.parsed_last)
        assert incoming == [{"role": "user", "content": f"question {number}"}]
        assert len(rows) == 2 * number - 1
        session.answer(f"answer {number}")
    assert work[10] == work[1000] == (1, 2)  # one statement; the last answer and the new question
    fresh, _ = load(KeptHistories(), session_pk, "none")
    assert rows == fresh[:-1]


def test_a_compaction_is_noticed_and_the_history_read_again(session_pk):
    kept, session = KeptHistories(), Session_(session_pk)
    for number in range(1, 6):
        turn_id = session.start_turn(f"question {number}")
        rows, _ = load(kept, session_pk, turn_id)
        session.answer(f"answer {number}")
    rows, _ = load(kept, session_pk, turn_id)
    # The oldest message alone replaced by a one-message summary: same count of rows before the cut.
    apply_compaction(
        session_pk,
        session.seq,
        rows,
        Compaction(keep_last=len(rows) - 1, summary=[{"role": "system", "content": "summary"}]),
    )
    turn_id = session.start_turn("question 6")
    rows, incoming = load(kept, session_pk, turn_id)
    assert kept.parsed_last == len(rows)  # read again
    assert rows == load(KeptHistories(), session_pk, turn_id)[0]
    assert rows[0][1] == {"role": "system", "content": "summary"}
    assert incoming == [{"role": "user", "content": "question 6"}]


def test_a_window_that_drops_the_oldest_rows_is_followed_without_reading_again(session_pk):
    kept, session = KeptHistories(), Session_(session_pk)
    for number in range(1, 6):
        turn_id = session.start_turn(f"question {number}")
        rows, _ = load(kept, session_pk, turn_id)
        session.answer(f"answer {number}")
    rows, _ = load(kept, session_pk, turn_id)
    apply_compaction(session_pk, session.seq, rows, Compaction(keep_last=4, summary=[]))
    turn_id = session.start_turn("question 6")
    rows, incoming = load(kept, session_pk, turn_id)
    assert kept.parsed_last == 1  # only the new question was read
    assert rows == load(KeptHistories(), session_pk, turn_id)[0]
    assert len(rows) == 5 and incoming == [{"role": "user", "content": "question 6"}]


def test_rows_replaced_at_the_end_are_noticed_and_the_history_read_again(session_pk):
    """A lost turn whose worker finished after all has its recovered output replaced by the
    real one: the same positions, new rows. A kept copy that holds the old rows is stale."""
    kept, session = KeptHistories(), Session_(session_pk)
    for number in range(1, 4):
        turn_id = session.start_turn(f"question {number}")
        session.answer(f"answer {number}")
    rows, _ = load(kept, session_pk, turn_id)
    Message.objects.filter(session_id=session_pk, seq=session.seq).delete()
    store.insert_messages(session_pk, session.seq, [{"role": "assistant", "content": "the real answer"}])
    turn_id = session.start_turn("question 4")
    rows, incoming = load(kept, session_pk, turn_id)
    assert kept.parsed_last == len(rows)  # read again
    assert rows == load(KeptHistories(), session_pk, turn_id)[0]
    assert rows[-2][1] == {"role": "assistant", "content": "the real answer"}
    assert incoming == [{"role": "user", "content": "question 4"}]


def test_planning_the_same_turn_again_still_finds_its_messages(session_pk):
    kept, session = KeptHistories(), Session_(session_pk)
    turn_id = session.start_turn("question 1")
    first = load(kept, session_pk, turn_id)
    assert load(kept, session_pk, turn_id) == first
    assert kept.parsed_last == 0 and first[1] == [{"role": "user", "content": "question 1"}]


def test_a_process_keeps_a_bounded_number_of_sessions(session_pk):
    created = session_create(
        tenant=Tenant.objects.get(name="demo"), agent_config={"name": "echo"}, messages=None, tools=None
    )
    other_pk = Session.objects.get(public_id=created.public_id).pk
    kept = KeptHistories(size=1)
    one, two = Session_(session_pk), Session_(other_pk)
    first, second = one.start_turn("question 1"), two.start_turn("question 1")
    load(kept, session_pk, first)
    load(kept, session_pk, first)
    assert kept.parsed_last == 0  # kept
    load(kept, other_pk, second)  # the other session takes the only place
    load(kept, session_pk, first)
    assert kept.parsed_last == 1  # read again
