"""Idempotency-Key: a retry of a request that created a session or started a turn gets
the same session or turn back (the IETF draft's semantics, as Stripe uses them).

The key is stored in the transaction that creates the thing, so a refused request (4xx)
stores nothing, its key included, and a key is never stored without what it created.
"""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError
from django.utils import timezone

from infra.service_errors import IdempotencyKeyReused

from ..models import IdempotencyKey


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
