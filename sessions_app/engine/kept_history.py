"""A worker's copy of each recent session's compacted history, parsed, so a turn reads and
parses only the rows its session gained since this worker last ran one of its turns (each
sessions_app.engine.worker.Worker keeps its own `KeptHistories`).

A kept copy is used only when the rows it was built from are still there, checked with two
index probes whatever the history's length: the session's first compacted row and its last
one at or before the copy's end must be rows of the copy (the same position and row id).
History only grows at its end; compaction deletes rows at its start and inserts any summary
there, always with new, higher ids; a lost turn whose worker finished after all has its
recovered output replaced at the end, with new ids too. So a first row that is one of the
copy's means nothing was inserted before it (a window that dropped the oldest rows leaves
the copy's rows from there on), and a last row that is the copy's last means nothing at its
end was replaced. Otherwise the whole history is read again.
The copy is only ever read: each turn gets new lists.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from . import store

SESSIONS_KEPT = 64  # per worker; a session's copy is at most its compacted history
BEFORE_EVERYTHING = -(2**62)


@dataclass(frozen=True)
class _Kept:
    seqs: tuple[int, ...]  # in order
    messages: tuple[dict, ...]
    turns: tuple[str | None, ...]  # the turn id each row was stored with
    ids: tuple[int, ...]  # row ids

    def start_of(self, first: tuple[int, int] | None, last: tuple[int, int] | None) -> int | None:
        """Where the rows still there begin in this copy, or None when the copy is stale."""
        if first is None or last is None or last != (self.seqs[-1], self.ids[-1]):
            return None
        index = bisect.bisect_left(self.seqs, first[0])
        if index == len(self.seqs) or (self.seqs[index], self.ids[index]) != first:
            return None
        return index


class KeptHistories:
    def __init__(self, size: int = SESSIONS_KEPT):
        self.size = size
        self._kept: OrderedDict[int, _Kept] = OrderedDict()
        self._lock = threading.Lock()  # worker threads plan turns at the same time
        self.parsed_last = 0  # rows the last load parsed (observability, tests)

    def load(self, session_pk: int, turn_id: str) -> tuple[list[int], list[dict], list[dict]]:
        """The session's compacted history (its positions and its messages, in order) and the
        messages of `turn_id` in it. New lists each time: the caller may change them."""
        with self._lock:
            kept = self._kept.pop(session_pk, None)
        start = None
        if kept is not None:
            first, last, new = store.compacted_history_after(session_pk, kept.seqs[-1])
            start = kept.start_of(first, last)
        if kept is None or start is None:
            kept, start = None, 0
            _, _, new = store.compacted_history_after(session_pk, BEFORE_EVERYTHING)
        seqs = list(kept.seqs[start:]) if kept else []
        messages = list(kept.messages[start:]) if kept else []
        turns = list(kept.turns[start:]) if kept else []
        ids = list(kept.ids[start:]) if kept else []
        for seq, data, row_turn, row_id in new:
            seqs.append(seq)
            messages.append(json.loads(data))
            turns.append(row_turn)
            ids.append(row_id)
        self.parsed_last = len(new)
        if seqs:
            with self._lock:
                self._kept[session_pk] = _Kept(tuple(seqs), tuple(messages), tuple(turns), tuple(ids))
                while len(self._kept) > self.size:
                    self._kept.popitem(last=False)
        # A turn's messages are the history's last rows as it is planned: only the running turn
        # writes to its session. (A retried plan of the same turn finds them in the kept copy.)
        own = len(turns)
        while own and turns[own - 1] == turn_id:
            own -= 1
        return seqs, messages, messages[own:]

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
