"""AAP v3 endpoints. Thin: validate with a protocol serializer, call one service, answer.
And the parsers of the bodies that carry messages (the v2-era views use them too)."""

import re

from django.conf import settings
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from agents.selectors import agent_info, agents_for_tenant
from infra.errors import LimitedJSONParser
from infra.service_errors import BadRequest, NotFound
from sessions_app.engine import events
from sessions_app.engine.stream import chosen_turn_id, rebuilt_response, turn_response
from tenancy.authentication import (
    BearerTokenAuthentication,
    EventsTicketAuthentication,
    TenantUser,
    turn_events_ticket,
)

from .. import protocol
from ..models import Turn
from . import admission, selectors
from .services import sessions, turns
from .services.validation import check_body_size, check_request_size

ERRORS = {
    400: protocol.ErrorSerializer,
    401: protocol.ErrorSerializer,
    404: protocol.ErrorSerializer,
}


IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key",
    {"type": "string", "minLength": 1, "maxLength": 255},
    OpenApiParameter.HEADER,
    description="Makes a retry safe: the same key and request get the same session or turn back; "
    "the same key with another request is 422.",
)
RETRY_ERRORS = {422: protocol.ErrorSerializer, 503: protocol.ErrorSerializer}


# Each parser counts the body's messages, content parts and tools before the body is parsed
# (services.validation.check_body_size): 200,000 tiny messages are refused without building
# 200,000 dicts.
class TurnBodyParser(LimitedJSONParser):
    """A turn's request: at most AAP_MAX_TURN_MESSAGES messages."""

    seed = False

    def check_before_parse(self, raw: bytes) -> None:
        check_body_size(raw, seed=self.seed)


class SessionBodyParser(TurnBodyParser):
    """A session's creation: its seed history holds at most AAP_MAX_SEED_MESSAGES messages."""

    seed = True


def idempotency(request) -> tuple[str, str] | None:
    """(Idempotency-Key, fingerprint of the request) when the client sent the header."""
    key = request.headers.get("Idempotency-Key")
    if key is None:
        return None
    if not 1 <= len(key) <= 255 or not key.isprintable() or not key.isascii():
        raise BadRequest("Idempotency-Key must be 1 to 255 printable ASCII characters (e.g. a UUID).")
    return key, admission.fingerprint(request.method, request.path, request.data)


class MetaView(APIView):
    @extend_schema(
        summary="Discover agents",
        responses={200: protocol.MetaSerializer, 401: protocol.ErrorSerializer},
    )
    def get(self, request):
        tenant = request.user.tenant if isinstance(request.user, TenantUser) else None
        agents = agents_for_tenant(tenant)
        if tenant is None:
            agents = agents.filter(tenants__isnull=True)  # public discovery: open agents only
        return Response({"version": 3, "agents": [agent_info(agent) for agent in agents]})

    def get_permissions(self):
        if settings.AAP_PUBLIC_META:
            return [AllowAny()]
        return super().get_permissions()


class SessionsView(APIView):
    parser_classes = [SessionBodyParser]

    @extend_schema(
        summary="Create a session",
        request=protocol.CreateSessionSerializer,
        parameters=[IDEMPOTENCY_KEY],
        responses={201: protocol.SessionIdSerializer, **ERRORS, **RETRY_ERRORS},
    )
    def post(self, request):
        check_request_size(request.data, seed=True)
        data = protocol.validate(protocol.CreateSessionSerializer, request.data)
        session = sessions.session_create(
            tenant=request.user.tenant,
            agent_config=data["agent"],
            messages=data.get("messages"),
            tools=data.get("tools"),
            idempotency=idempotency(request),
        )
        return Response({"sessionId": session.public_id}, status=status.HTTP_201_CREATED)

    @extend_schema(
        summary="List sessions, newest first",
        parameters=[protocol.SessionListQuerySerializer],
        responses={200: protocol.SessionListSerializer, **ERRORS},
    )
    def get(self, request):
        query = protocol.validate(protocol.SessionListQuerySerializer, request.query_params)
        return Response(selectors.sessions_page(request.user.tenant, after=query.get("after"), limit=query["limit"]))


class SessionView(APIView):
    @extend_schema(summary="Get a session", responses={200: protocol.SessionInfoSerializer, **ERRORS})
    def get(self, request, session_id):
        return Response(selectors.session_info(selectors.session_for_tenant(request.user.tenant, session_id)))

    @extend_schema(summary="Delete a session and its history", responses={204: None, **ERRORS})
    def delete(self, request, session_id):
        sessions.session_delete(tenant=request.user.tenant, session_id=session_id)
        return Response(status=status.HTTP_204_NO_CONTENT)


class HistoryView(APIView):
    @extend_schema(
        summary="Read a session's history",
        parameters=[protocol.HistoryQuerySerializer],
        responses={200: protocol.HistorySerializer, **ERRORS},
    )
    def get(self, request, session_id):
        session = selectors.session_for_tenant(request.user.tenant, session_id)
        query = protocol.validate(protocol.HistoryQuerySerializer, request.query_params)
        return selectors.history_response(session, query["type"])


TURN_RESPONSES = {
    200: OpenApiResponse(
        protocol.TurnResponseSerializer,
        description='`stream: "none"`: this JSON. `"delta"` / `"message"`: `text/event-stream` of AAP events '
        "(`turn_start`, `text_delta`/`text`, `thinking_delta`/`thinking`, `tool_call`, `tool_result`, `turn_stop`), "
        "each with an `id:`; the `AAP-Turn-Id` header names the turn.",
    ),
    409: protocol.ErrorSerializer,
    **ERRORS,
}


class TurnsView(APIView):
    parser_classes = [TurnBodyParser]

    @extend_schema(
        summary="Send a turn",
        request=protocol.TurnRequestSerializer,
        parameters=[IDEMPOTENCY_KEY],
        responses={**TURN_RESPONSES, **RETRY_ERRORS},
    )
    def post(self, request, session_id):
        check_request_size(request.data, seed=False)
        data = protocol.validate(protocol.TurnRequestSerializer, request.data)
        turn = turns.turn_start(
            tenant=request.user.tenant,
            session_id=session_id,
            data=data,
            idempotency=idempotency(request),
            turn_id=chosen_turn_id(request),
        )
        response = turn_response(turn.id, turn.stream, token_id=request.user.token.pk)
        response["AAP-Events-Ticket"] = turn_events_ticket(request.user.token, session_id, turn.id)
        return response


def _last_event_id(request) -> int:
    raw = request.headers.get("Last-Event-ID") or request.query_params.get("after") or "0"
    # ASCII digits only: str.isdigit() also accepts "²", which int() refuses.
    if not re.fullmatch(r"[0-9]{1,18}", raw):
        raise BadRequest("Last-Event-ID must be the number of the last event you received (its 'id:').")
    return int(raw)


class TurnView(APIView):
    """`GET /v1/sessions/:id/turns/:turnId` (an extension): a turn's state and, once it has
    ended, its stored result, from PostgreSQL alone: what a client whose stream broke reads
    when the turn's events are no longer kept."""

    @extend_schema(
        summary="A turn's state and stored result",
        responses={200: OpenApiTypes.OBJECT, **ERRORS},
    )
    def get(self, request, session_id, turn_id):
        return Response(turns.turn_read(tenant=request.user.tenant, session_id=session_id, turn_id=turn_id))


class TurnEventsView(APIView):
    # A browser's EventSource cannot send Authorization: it re-attaches with ?ticket=.
    authentication_classes = [BearerTokenAuthentication, EventsTicketAuthentication]

    @extend_schema(
        summary="Re-attach to a turn's events",
        parameters=[
            OpenApiParameter(
                "Last-Event-ID",
                {"type": "integer", "minimum": 0, "maximum": 10**18 - 1},
                OpenApiParameter.HEADER,
                description="The id of the last event received (default 0: from the start).",
            ),
            OpenApiParameter(
                "after",
                {"type": "integer", "minimum": 0, "maximum": 10**18 - 1},
                description="Same as Last-Event-ID, for clients that cannot set headers.",
            ),
            OpenApiParameter(
                "ticket",
                OpenApiTypes.STR,
                description="The turn's `AAP-Events-Ticket` header, for clients that cannot send "
                "`Authorization` (a browser's EventSource). Valid for this turn only.",
            ),
        ],
        responses={
            200: OpenApiResponse(description="text/event-stream of the events after Last-Event-ID"),
            204: OpenApiResponse(description="The reader already has the turn's turn_stop."),
            **ERRORS,
        },
    )
    def get(self, request, session_id, turn_id):
        after = _last_event_id(request)
        scope = request.user.turn_scope
        if scope is not None and scope != (session_id, turn_id):
            raise NotFound(f"No turn '{turn_id}' exists on session '{session_id}' for this events ticket.")
        turn = Turn.objects.filter(
            id=turn_id, session__public_id=session_id, session__tenant=request.user.tenant
        ).first()
        if turn is None:
            raise NotFound(f"No turn '{turn_id}' exists on session '{session_id}' for this token's tenant.")
        mode = "delta" if turn.stream == "delta" else "message"
        if turn.status == Turn.DONE:
            last = events.backend().last_sync(turn.id)
            if last is None:
                # Gone with Redis (a restart, a flush) or past their retention: a reader from
                # the start gets the stream rebuilt from history; one from a later event
                # cannot be told where it stands, and reads the stored result.
                rebuilt = rebuilt_response(turn.id, mode) if after == 0 else None
                if rebuilt is not None:
                    return rebuilt
                raise NotFound(
                    f"The events of turn '{turn_id}' are no longer kept; GET "
                    f"/v1/sessions/{session_id}/turns/{turn_id} gives its stored result."
                )
            if last[1].get("event") == "turn_stop" and last[0] <= after:
                # The reader has everything: 204 tells an EventSource to stop reconnecting.
                return Response(status=status.HTTP_204_NO_CONTENT)
        return turn_response(turn.id, mode, after=after, token_id=request.auth.pk)


class TurnCancelView(APIView):
    @extend_schema(
        summary="Cancel a running turn", request=None, responses={202: protocol.TurnCancelSerializer, **ERRORS}
    )
    def post(self, request, session_id, turn_id):
        turn = turns.turn_cancel(tenant=request.user.tenant, session_id=session_id, turn_id=turn_id)
        return Response({"turnId": turn.id, "cancelling": turn.status != Turn.DONE}, status=status.HTTP_202_ACCEPTED)


class UsageView(APIView):
    """`GET /v1/usage` (an extension): the calling tenant's own usage."""

    @extend_schema(
        summary="Your usage: turns, model tokens and turn time",
        parameters=[
            OpenApiParameter(
                "from", OpenApiTypes.STR, description="Date or RFC 3339 time (default: 30 days before `to`)."
            ),
            OpenApiParameter(
                "to", OpenApiTypes.STR, description="Exclusive end, date or RFC 3339 time (default: now)."
            ),
            OpenApiParameter("groupBy", OpenApiTypes.STR, enum=list(selectors.USAGE_GROUPS)),
        ],
        responses={200: OpenApiTypes.OBJECT, **ERRORS},
    )
    def get(self, request):
        query = selectors.usage_query(request.query_params)
        return Response(selectors.usage(request.user.tenant, **query))
