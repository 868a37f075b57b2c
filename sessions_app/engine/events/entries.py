"""A read of a turn's stream: its (seq, event) pairs and how many bytes they came as."""

from __future__ import annotations


class Entries(list):
    """(seq, event) pairs in order; `size`: the bytes read for them (0 where nothing is copied)."""

    size = 0


# A follower reads a stream in rounds of at most this many bytes about (entries are at most
# turn_output.JOINED_CHARS): it holds one round while its client is slow, not the whole turn.
ROUND_BYTES = 64 * 1024
MIN_COUNT, MAX_COUNT = 4, 500


def next_count(count: int, read: Entries) -> int:
    """How many entries the next round asks for, after a round of `count` gave `read`."""
    if read.size > ROUND_BYTES:
        return MIN_COUNT
    if len(read) >= count and read.size < ROUND_BYTES // 4:
        return min(MAX_COUNT, count * 4)
    return count
