"""Reads of sessions and history, in AAP shapes."""

from __future__ import annotations

import base64
import binascii

from django.http import HttpResponse

from hosting.errors import BadRequest, NotFound

from .models import Message, Session
from .services import redacted_options


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
    agent = {"name": session.agent.name}
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
        Session.objects.filter(tenant=tenant)
        .select_related("agent")
        .prefetch_related("agent__options")
        .order_by("-pk")
    )
    if after:
        qs = qs.filter(pk__lt=decode_cursor(after))
    rows = list(qs[: limit + 1])
    body = {"sessions": [session_info(s) for s in rows[:limit]]}
    if len(rows) > limit:
        body["next"] = encode_cursor(rows[limit - 1].pk)
    return body


def history_response(session: Session, history_type: str) -> HttpResponse:
    """The stored JSON texts joined as they are: the history is byte-for-byte what was kept."""
    if history_type not in session.agent.capabilities().get("history", {}):
        raise NotFound(f"Agent '{session.agent.name}' does not keep '{history_type}' history.")
    texts = Message.objects.filter(session=session, kind=history_type).order_by("seq").values_list("data", flat=True)
    body = '{"history":{"%s":[%s]}}' % (history_type, ",".join(texts))
    return HttpResponse(body.encode(), content_type="application/json")
