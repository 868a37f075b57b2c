"""What happens at the door before a session or turn is stored: a tenant's limits, and a
request that was already let in.

Limits: a tenant's turn or session is refused with 429 before anything is stored when it would
pass one of the tenant's limits (infra.limits). Running and queued turns and sessions are
counted in PostgreSQL, inside the transaction that stores the new row, under a per-tenant
advisory lock: two requests arriving together cannot both take the last place, and a refused
request leaves nothing behind (its transaction rolls back). Turns per minute are a Redis
window (infra.limits).

Idempotency-Key: a retry of a request that created a session or started a turn gets the same
session or turn back (the IETF draft's semantics, as Stripe uses them). The key is stored in
the transaction that creates the thing, so a refused request (4xx) stores nothing, its key
included, and a key is never stored without what it created.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime, timedelta
from datetime import time as dt_time

from django.conf import settings
from django.db import IntegrityError, connection
from django.db.models import Count, F, Sum
from django.utils import timezone

from infra.limits import limits_for, take_turn
from infra.service_errors import IdempotencyKeyReused, TooManyRequests

from ..models import IdempotencyKey, Session, Turn

# Advisory lock keys of this module: a namespace in the high bits, the tenant id below.
_LOCK_NAMESPACE = 0x4141_5000 << 32


def _lock_tenant(tenant) -> None:
    """Serialize admission of one tenant's rows until the transaction ends (PostgreSQL;
    SQLite already runs one writing transaction at a time)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_LOCK_NAMESPACE | (tenant.pk & 0xFFFF_FFFF)])


def _retry_seconds() -> float:
    return float(settings.AAP_LIMITS_RETRY_SECONDS)


def active_turns(tenant) -> dict[str, int]:
    """The tenant's turns not yet ended, by status (queued, running)."""
    rows = (
        Turn.objects.filter(session__tenant_id=tenant.pk, status__in=(Turn.QUEUED, Turn.RUNNING))
        .values("status")
        .annotate(n=Count("id"))
    )
    counts = {Turn.QUEUED: 0, Turn.RUNNING: 0}
    counts.update({row["status"]: row["n"] for row in rows})
    return counts


def tokens_today(tenant) -> int:
    """LLM tokens (prompt + completion) of the tenant's turns started this UTC day."""
    midnight = datetime.combine(timezone.now().astimezone(UTC).date(), dt_time.min, UTC)
    total = Turn.objects.filter(session__tenant_id=tenant.pk, created_at__gte=midnight).aggregate(
        n=Sum(F("prompt_tokens") + F("completion_tokens"))
    )["n"]
    return int(total or 0)


def _seconds_to_midnight() -> float:
    now = timezone.now().astimezone(UTC)
    tomorrow = datetime.combine(now.date() + timedelta(days=1), dt_time.min, UTC)
    return (tomorrow - now).total_seconds()


def admit_turn(*, tenant) -> None:
    """Inside turn_start's transaction, before the turn is stored: raise TooManyRequests
    (429) if the tenant is at its running/queued turns, tokens per day or turns per minute."""
    limits = limits_for(tenant)
    if limits.max_running_turns:
        _lock_tenant(tenant)
        counts = active_turns(tenant)
        active = counts[Turn.QUEUED] + counts[Turn.RUNNING]
        room = limits.max_running_turns + limits.max_queued_turns
        if active >= room:
            if limits.max_queued_turns:
                message = (
                    f"This tenant already has {active} turns running or waiting for a worker, its limit "
                    f"({limits.max_running_turns} running + {limits.max_queued_turns} queued turns); "
                    "retry when one of them ends."
                )
                name = "queuedTurns"
            else:
                message = (
                    f"This tenant already has {active} turns running, its limit of {limits.max_running_turns} "
                    "concurrent running turns; retry when one of them ends."
                )
                name = "runningTurns"
            raise TooManyRequests(message, retry_after=_retry_seconds(), limit=name)
    if limits.tokens_per_day:
        used = tokens_today(tenant)
        if used >= limits.tokens_per_day:
            wait = _seconds_to_midnight()
            raise TooManyRequests(
                f"This tenant has used {used} of its {limits.tokens_per_day} LLM tokens for today (UTC); "
                f"the allowance renews in {int(wait // 3600)} h {int(wait % 3600 // 60)} min.",
                retry_after=wait,
                limit="tokensPerDay",
            )
    take_turn(tenant)  # last: a turn refused above does not use up the tenant's rate


def admit_session(*, tenant) -> None:
    """Inside session_create's transaction: raise TooManyRequests at the tenant's session limit."""
    limit = limits_for(tenant).max_sessions
    if not limit:
        return
    _lock_tenant(tenant)
    count = Session.objects.filter(tenant_id=tenant.pk).count()
    if count >= limit:
        raise TooManyRequests(
            f"This tenant already keeps {count} sessions, its limit of {limit}; delete sessions it no longer "
            "needs (DELETE /v1/sessions/:id) or ask the operator to raise the limit.",
            retry_after=_retry_seconds(),
            limit="sessions",
        )


# --- Idempotency-Key ---


def fingerprint(method: str, path: str, data) -> str:
    """What makes two requests "the same" for an Idempotency-Key: method, path and JSON body
    (compared as JSON: key order and spacing do not matter)."""
    text = json.dumps([method, path, data], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def replayed(tenant, idempotency: tuple[str, str] | None) -> IdempotencyKey | None:
    """The stored outcome of an earlier request with this key (422 if it was another request)."""
    if idempotency is None:
        return None
    key, print_ = idempotency
    row = IdempotencyKey.objects.filter(tenant=tenant, key=key).first()
    if row is None:
        return None
    if row.created_at < timezone.now() - timedelta(seconds=settings.AAP_IDEMPOTENCY_SECONDS):
        row.delete()  # expired: the key may be used afresh
        return None
    if row.fingerprint != print_:
        raise IdempotencyKeyReused(
            "This Idempotency-Key was already used with a different request; send a new key for a new request."
        )
    return row


def remember(tenant, idempotency: tuple[str, str] | None, session_public_id: str, turn_id: str = "") -> None:
    """Store the key with what the request created (inside the creating transaction)."""
    if idempotency is not None:
        IdempotencyKey.objects.create(
            tenant=tenant,
            key=idempotency[0],
            fingerprint=idempotency[1],
            session_public_id=session_public_id,
            turn_id=turn_id,
        )


def create_once(create, tenant, idempotency: tuple[str, str] | None):
    """Run `create` -> (created, None); if a concurrent request with the same key committed
    first, -> (None, its stored key row)."""
    try:
        return create(), None
    except IntegrityError:
        if idempotency is None:
            raise
        row = replayed(tenant, idempotency)
        if row is None:
            raise
        return None, row
