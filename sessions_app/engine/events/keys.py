"""The Redis keys and channels of a turn's live events, end fence, lease, dispatch mark and
cancel flag."""

from __future__ import annotations

from django.conf import settings

CANCEL_CHANNEL = "aap:cancel"


def live_stream_ttl() -> int:
    """How long a running turn's stream (and its cancel flag) is kept: longer than any turn."""
    return settings.AAP_LIVE_EVENTS_TTL_SECONDS


def stream_key(turn_id: str) -> str:
    return f"aap:ev:{turn_id}"


def ended_key(turn_id: str) -> str:
    """Set with a turn's `turn_stop`: its stream takes no event after that (the fence)."""
    return f"aap:end:{turn_id}"


def lease_key(turn_id: str) -> str:
    return f"aap:lease:{turn_id}"


def cancel_key(turn_id: str) -> str:
    return f"aap:cancel:{turn_id}"


def notify_channel(turn_id: str) -> str:
    return f"aap:evn:{turn_id}"
