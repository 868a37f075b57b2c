"""A worker's copy of each recent session's compacted history, parsed, so a turn reads and
parses only the rows its session gained since this process last ran one of its turns.

A kept copy is used only when the rows it was built from are still there: the same highest
row id among the compacted rows at or before its last position, and no more of them
(history only grows at its end; compaction deletes rows at its start and inserts any
summary there, always with new, higher ids). Fewer rows with the same highest id mean a
window dropped the oldest: the kept copy's last ones are what is left. Otherwise the whole
history is read again.
The copy is only ever read: each turn gets new lists.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from .. import turn_store

SESSIONS_KEPT = 64  # per worker process; a session's copy is at most its compacted history
BEFORE_EVERYTHING = -(2**62)


@dataclass(frozen=True)
class _Kept:
    rows: tuple[tuple[int, dict, str | None], ...]  # (seq, message, turn id) in order
    last_seq: int
    top_id: int


class KeptHistories:
    def __init__(self, size: int = SESSIONS_KEPT):
        self.size = size
        self._kept: OrderedDict[int, _Kept] = OrderedDict()
        self._lock = threading.Lock()  # worker threads plan turns at the same time
        self.parsed_last = 0  # rows the last load parsed (observability, tests)

    def load(self, session_pk: int, turn_id: str) -> tuple[list[tuple[int, dict]], list[dict]]:
        """The session's compacted history as (seq, message), and the messages of `turn_id` in it."""
        with self._lock:
            kept = self._kept.pop(session_pk, None)
        rows: list[tuple[int, dict, str | None]] = []
        if kept is not None:
            count, top, new = turn_store.compacted_history_after(session_pk, kept.last_seq)
            if top == kept.top_id and count <= len(kept.rows):
                # Unchanged, or compaction only dropped rows at the start (a window): the
                # rows left are the kept copy's last `count`. A summary inserted moves `top`.
                rows = list(kept.rows[len(kept.rows) - count :]) if count else []
            else:
                kept = None
        if kept is None:
            _, _, new = turn_store.compacted_history_after(session_pk, BEFORE_EVERYTHING)
        top_id = kept.top_id if kept is not None else 0
        for seq, data, row_turn, row_id in new:
            rows.append((seq, json.loads(data), row_turn))
            top_id = max(top_id, row_id)
        self.parsed_last = len(new)
        if rows:
            with self._lock:
                self._kept[session_pk] = _Kept(tuple(rows), rows[-1][0], top_id)
                while len(self._kept) > self.size:
                    self._kept.popitem(last=False)
        # (a retried plan of the same turn finds its rows in the kept copy: look at all of them)
        incoming = [message for _, message, row_turn in rows if row_turn == turn_id]
        return [(seq, message) for seq, message, _ in rows], incoming

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()


kept_histories = KeptHistories()
