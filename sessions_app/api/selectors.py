"""Reads of sessions and history, in AAP shapes."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any

from django.http import HttpResponse

from infra.service_errors import BadRequest, NotFound

from ..models import Message, Session
from .services.validation import redacted_options


def session_for_tenant(tenant, session_id: str) -> Session:
    session = (
        Session.objects.select_related("agent")
        .prefetch_related("agent__options")
        .filter(public_id=session_id, tenant=tenant)
        .first()
    )
    if session is None:
        raise NotFound(f"No session '{session_id}' exists for this token's tenant.")
    return session


def session_info(session: Session) -> dict:
    agent: dict[str, Any] = {"name": session.agent.name}
    if session.server_tools is not None:
        agent["tools"] = session.server_tools
    if session.options:
        agent["options"] = redacted_options(session.agent, session.options)
    info = {"sessionId": session.public_id, "agent": agent}
    if session.client_tools is not None:
        info["tools"] = session.client_tools
    return info


def encode_cursor(pk: int) -> str:
    return base64.urlsafe_b64encode(f"s1:{pk}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        version, _, pk = raw.partition(":")
        if version != "s1" or not pk.isdigit():
            raise ValueError
        return int(pk)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise BadRequest("The 'after' cursor is not one this server issued; pass the 'next' value as is.") from None


def sessions_page(tenant, *, after: str | None, limit: int) -> dict:
    """Newest first; the cursor is the last row's key, so inserts never shift a page."""
    qs = (
        Session.objects.filter(tenant=tenant).select_related("agent").prefetch_related("agent__options").order_by("-pk")
    )
    if after:
        qs = qs.filter(pk__lt=decode_cursor(after))
    rows = list(qs[: limit + 1])
    body: dict[str, Any] = {"sessions": [session_info(s) for s in rows[:limit]]}
    if len(rows) > limit:
        body["next"] = encode_cursor(rows[limit - 1].pk)
    return body


def history_messages(session: Session, history_type: str) -> list[dict]:
    """The stored messages of one history type, parsed (the caller checked the agent keeps it)."""
    texts = Message.objects.filter(session=session, kind=history_type).order_by("seq").values_list("data", flat=True)
    return [json.loads(text) for text in texts]


def history_response(session: Session, history_type: str) -> HttpResponse:
    """The stored JSON texts joined as they are: the history is byte-for-byte what was kept."""
    if history_type not in session.agent.capabilities().get("history", {}):
        raise NotFound(f"Agent '{session.agent.name}' does not keep '{history_type}' history.")
    texts = Message.objects.filter(session=session, kind=history_type).order_by("seq").values_list("data", flat=True)
    body = '{"history":{"%s":[%s]}}' % (history_type, ",".join(texts))
    return HttpResponse(body.encode(), content_type="application/json")


# --- usage ------------------------------------------------------------------------------------

USAGE_GROUPS = {"agent": "agent", "session": "sessionId", "day": "day"}
USAGE_MAX_DAYS = 366
USAGE_MAX_ROWS = 1000


def _usage_time(name: str, raw: str):
    from datetime import UTC, datetime, time

    from django.utils.dateparse import parse_date, parse_datetime

    try:
        moment = parse_datetime(raw)
        if moment is None:
            day = parse_date(raw)
            if day is None:
                raise ValueError
            moment = datetime.combine(day, time.min, tzinfo=UTC)
    except ValueError:
        raise BadRequest(
            f"'{name}' must be a date (2026-11-23) or an RFC 3339 time (2026-11-23T10:00:00Z); got {raw[:40]!r}."
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment


def usage_query(params) -> dict:
    """Validate `from`, `to` (exclusive; default: the last 30 days up to now) and `groupBy`."""
    from datetime import timedelta

    from django.utils import timezone

    group_by = params.get("groupBy", "agent")
    if group_by not in USAGE_GROUPS:
        raise BadRequest(f"groupBy must be one of: {', '.join(USAGE_GROUPS)} (got {group_by[:40]!r}).")
    end = _usage_time("to", params["to"]) if params.get("to") else timezone.now()
    try:
        start = _usage_time("from", params["from"]) if params.get("from") else end - timedelta(days=30)
    except OverflowError:
        raise BadRequest("'to' is too early; give a date after 0001-01-31.") from None
    if start >= end:
        raise BadRequest("'from' must be before 'to' (which is exclusive).")
    if end - start > timedelta(days=USAGE_MAX_DAYS):
        raise BadRequest(f"Ask for at most {USAGE_MAX_DAYS} days at a time; split a longer range into several calls.")
    return {"start": start, "end": end, "group_by": group_by}


def _usage_numbers(row: Mapping[str, Any]) -> dict:
    seconds = row["seconds"]
    return {
        "turns": row["turns"],
        "promptTokens": row["prompt"] or 0,
        "completionTokens": row["completion"] or 0,
        "modelCalls": row["calls"] or 0,
        "estimatedTurns": row["estimated"] or 0,
        "turnSeconds": round(seconds.total_seconds(), 3) if seconds else 0.0,
    }


def usage(tenant, *, start, end, group_by: str) -> dict:
    """A tenant's turns created in [start, end): counts, model tokens and the time turns ran,
    grouped by agent, session or UTC day. Turns of deleted sessions are gone with them."""
    from datetime import UTC

    from django.db.models import Count, DurationField, ExpressionWrapper, F, Q, Sum
    from django.db.models.functions import TruncDate

    from ..models import Turn

    keys = {
        "agent": F("session__agent__name"),
        "session": F("session__public_id"),
        "day": TruncDate("created_at", tzinfo=UTC),
    }
    sums = {
        "turns": Count("id"),
        "prompt": Sum("prompt_tokens"),
        "completion": Sum("completion_tokens"),
        "calls": Sum("model_calls"),
        "estimated": Count("id", filter=Q(usage_estimated=True)),
        "seconds": Sum(ExpressionWrapper(F("finished_at") - F("started_at"), output_field=DurationField())),
    }
    turns = Turn.objects.filter(session__tenant=tenant, created_at__gte=start, created_at__lt=end)
    rows = list(turns.annotate(key=keys[group_by]).values("key").annotate(**sums).order_by("key")[: USAGE_MAX_ROWS + 1])
    label = USAGE_GROUPS[group_by]
    body = {
        "from": start.isoformat().replace("+00:00", "Z"),
        "to": end.isoformat().replace("+00:00", "Z"),
        "groupBy": group_by,
        "usage": [
            {label: row["key"].isoformat() if group_by == "day" else row["key"], **_usage_numbers(row)}
            for row in rows[:USAGE_MAX_ROWS]
        ],
        "total": _usage_numbers(turns.aggregate(**sums)),
    }
    if len(rows) > USAGE_MAX_ROWS:
        body["truncated"] = True  # the total still counts every turn
    return body


def usage_by_tenant(*, start, end) -> list[dict]:
    """Every tenant's turns created in [start, end) (the operator's view in the admin)."""
    from django.db.models import Count, DurationField, ExpressionWrapper, F, Q, Sum

    from ..models import Turn

    rows = (
        Turn.objects.filter(created_at__gte=start, created_at__lt=end)
        .values(tenant=F("session__tenant__name"))
        .annotate(
            turns=Count("id"),
            prompt=Sum("prompt_tokens"),
            completion=Sum("completion_tokens"),
            calls=Sum("model_calls"),
            estimated=Count("id", filter=Q(usage_estimated=True)),
            seconds=Sum(ExpressionWrapper(F("finished_at") - F("started_at"), output_field=DurationField())),
        )
        .order_by("tenant")
    )
    return [{"tenant": row["tenant"], **_usage_numbers(row)} for row in rows]
