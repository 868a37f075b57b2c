"""The v2-era AAP endpoints (seed 001) under `/v2/`: v2 shapes at the edge, the v3 services
behind. A session is one session whichever surface created it or continues it.

Where seed 001 says nothing (status codes, errors, cancel, re-attach, Idempotency-Key,
limits) the `/v2/` surface behaves as `/v1/` does (docs/api.md "v2-era clients")."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import APIView

from infra.errors import json_error
from infra.service_errors import BadRequest
from sessions_app import protocol
from sessions_app.engine.stream import HANDOFF_HEADER, chosen_turn_id, turn_response
from tenancy.authentication import turn_events_ticket

from .. import selectors
from .. import views as v3
from ..services import sessions, turns
from ..services.validation import check_request_size
from . import shapes
from .stream import mark

ERRORS = {**v3.ERRORS, **v3.RETRY_ERRORS}
TURN_STREAM = (
    '`stream: "delta"` / `"message"`: `text/event-stream` of AAP events (`turn_start`, `text_delta`/`text`, '
    "`thinking_delta`/`thinking`, `tool_call`, `tool_result`, `turn_stop`), each with an `id:`; the "
    "`AAP-Turn-Id` header names the turn."
)


def _started(request, session_id: str, turn, *, created: bool = False):
    """The turn's response (JSON or SSE, streamed by the hand-off), marked for v2 shapes."""
    response = turn_response(turn.id, turn.stream, token_id=request.user.token.pk)
    response["AAP-Events-Ticket"] = turn_events_ticket(request.user.token, session_id, turn.id)
    if created and turn.stream == "none":
        response.status_code = status.HTTP_201_CREATED
    return mark(response, session_id if created else None)


class MetaView(v3.MetaView):
    @extend_schema(
        summary="Discover agents (v2-era shapes)",
        responses={200: shapes.V2MetaSerializer, 401: protocol.ErrorSerializer},
    )
    def get(self, request):
        body = super().get(request).data
        return Response({"version": 2, "agents": [shapes.agent_info_to_v2(info) for info in body["agents"]]})


class SessionCreateView(APIView):
    parser_classes = [v3.SessionBodyParser]

    @extend_schema(
        summary="Create a session and run its first turn",
        request=shapes.V2CreateSessionSerializer,
        parameters=[v3.IDEMPOTENCY_KEY],
        responses={
            201: OpenApiResponse(shapes.V2SessionCreatedSerializer, description='`stream: "none"` (the default).'),
            200: OpenApiResponse(
                description=TURN_STREAM.replace(
                    "(`turn_start`", "(`session_start {sessionId}` first, then `turn_start`"
                )
            ),
            **ERRORS,
        },
    )
    def put(self, request):
        check_request_size(request.data, seed=True)
        data = protocol.validate(shapes.V2CreateSessionSerializer, request.data)
        session_id, turn = turns.session_open(
            tenant=request.user.tenant,
            **shapes.create_request_to_v3(data),
            idempotency=v3.idempotency(request),
            turn_id=chosen_turn_id(request),
        )
        return _started(request, session_id, turn, created=True)


class SessionView(APIView):
    parser_classes = [v3.TurnBodyParser]

    @extend_schema(
        summary="Send a turn",
        request=shapes.V2TurnRequestSerializer,
        parameters=[v3.IDEMPOTENCY_KEY],
        responses={
            200: OpenApiResponse(
                shapes.V2TurnResponseSerializer, description='`stream: "none"`: this JSON. ' + TURN_STREAM
            ),
            409: protocol.ErrorSerializer,
            **ERRORS,
        },
    )
    def post(self, request, session_id):
        check_request_size(request.data, seed=False)
        data = protocol.validate(shapes.V2TurnRequestSerializer, request.data)
        turn = turns.turn_start(
            tenant=request.user.tenant,
            session_id=session_id,
            data=shapes.turn_request_to_v3(data),
            idempotency=v3.idempotency(request),
            turn_id=chosen_turn_id(request),
        )
        return _started(request, session_id, turn)

    @extend_schema(summary="Get a session with its history", responses={200: shapes.V2SessionSerializer, **v3.ERRORS})
    def get(self, request, session_id):
        session = selectors.session_for_tenant(request.user.tenant, session_id)
        kept = session.agent.capabilities().get("history", {})
        history = {kind: selectors.history_messages(session, kind) for kind in protocol.HISTORY_TYPES if kind in kept}
        return Response(shapes.session_to_v2(selectors.session_info(session), history))

    @extend_schema(summary="Delete a session and its history", responses={204: None, **v3.ERRORS})
    def delete(self, request, session_id):
        sessions.session_delete(tenant=request.user.tenant, session_id=session_id)
        return Response(status=status.HTTP_204_NO_CONTENT)


class SessionsView(APIView):
    @extend_schema(
        summary="List session ids, newest first",
        parameters=[shapes.V2SessionListQuerySerializer],
        responses={200: shapes.V2SessionListSerializer, **v3.ERRORS},
    )
    def get(self, request):
        query = protocol.validate(shapes.V2SessionListQuerySerializer, request.query_params)
        try:
            page = selectors.sessions_page(request.user.tenant, after=query.get("after"), limit=query["limit"])
        except BadRequest:
            raise BadRequest(
                "The 'after' cursor is not one this server issued; pass the 'nextCursor' value as is."
            ) from None
        body = {"sessions": [info["sessionId"] for info in page["sessions"]]}
        if "next" in page:
            body["nextCursor"] = page["next"]
        return Response(body)


class TurnEventsView(v3.TurnEventsView):
    """Re-attach (an extension, as on /v1/): the turn's events in v2-era shapes."""

    def finalize_response(self, request, response, *args, **kwargs):
        response = super().finalize_response(request, response, *args, **kwargs)
        return mark(response) if response.has_header(HANDOFF_HEADER) else response


class TurnCancelView(v3.TurnCancelView):
    """Cancel (an extension, as on /v1/)."""


def v1_session_path(request, *args, **kwargs):
    """A v2-era path under /v1/ (`/v1/session`, `/v1/session/:id`): say where each surface lives."""
    return json_error(
        f"There is nothing at {request.path}: this server speaks AAP v3 under /v1/ (POST /v1/sessions, "
        "POST /v1/sessions/:id/turns) and the v2-era surface (PUT /session, POST /session/:id) under /v2/; "
        "a v2-era client's base URL is this server's /v2.",
        404,
    )
