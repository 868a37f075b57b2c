"""The OpenAPI document's parts that views cannot state: bearer auth, operation ids, the wire
shapes (sessions_app.protocol.WIRE_SCHEMAS), streamed media types, the answers every
request can get from the layers around the views, and links between operations."""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "tenancy.authentication.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "An API token of one tenant."}


class EventsTicketScheme(OpenApiAuthenticationExtension):
    target_class = "tenancy.authentication.EventsTicketAuthentication"
    name = "eventsTicket"

    def get_security_definition(self, auto_schema):
        return {
            "type": "apiKey",
            "in": "query",
            "name": "ticket",
            "description": "A turn's AAP-Events-Ticket: reads that turn's events only (EventSource).",
        }


OPERATION_IDS = {
    ("/v1/meta", "get"): "getMeta",
    ("/v1/sessions", "get"): "listSessions",
    ("/v1/sessions", "post"): "createSession",
    ("/v1/sessions/{session_id}", "get"): "getSession",
    ("/v1/sessions/{session_id}", "delete"): "deleteSession",
    ("/v1/sessions/{session_id}/history", "get"): "getHistory",
    ("/v1/sessions/{session_id}/turns", "post"): "sendTurn",
    ("/v1/sessions/{session_id}/turns/{turn_id}/events", "get"): "reattachTurn",
    ("/v1/sessions/{session_id}/turns/{turn_id}/cancel", "post"): "cancelTurn",
    ("/v2/meta", "get"): "v2GetMeta",
    ("/v2/session", "put"): "v2CreateSession",
    ("/v2/session/{session_id}", "post"): "v2SendTurn",
    ("/v2/session/{session_id}", "get"): "v2GetSession",
    ("/v2/session/{session_id}", "delete"): "v2DeleteSession",
    ("/v2/sessions", "get"): "v2ListSessions",
    ("/v2/session/{session_id}/turns/{turn_id}/events", "get"): "v2ReattachTurn",
    ("/v2/session/{session_id}/turns/{turn_id}/cancel", "post"): "v2CancelTurn",
}

ERROR = {"$ref": "#/components/schemas/Error"}


def _error(description: str, **headers) -> dict:
    answer = {"description": description, "content": {"application/json": {"schema": ERROR}}}
    if headers:
        answer["headers"] = {
            name: {"schema": {"type": "string"}, "description": text} for name, text in headers.items()
        }
    return answer


# Answers that come from the layers around a view (host validation, the body limit, the
# parser, DRF's method and content negotiation) or from a saturated dependency.
COMMON_ERRORS = {
    "400": _error("Bad input (the sentence names it), or a Host this server does not answer to."),
    "406": _error("The Accept header excludes JSON."),
    "503": _error("A dependency is briefly unavailable; nothing was stored.", **{"Retry-After": "Seconds to wait."}),
    "429": _error(
        "A tenant limit (details.limit names it), or too many unknown tokens from this address; nothing was stored.",
        **{
            "Retry-After": "Seconds to wait.",
            "RateLimit-Policy": 'The turns-per-minute policy, e.g. "turns";q=600;w=60.',
            "RateLimit": 'What remains of it and when it resets, e.g. "turns";r=597;t=42.',
        },
    ),
}
BODY_ERRORS = {
    "413": _error("The body is over the configured limit (AAP_MAX_BODY_BYTES)."),
    "415": _error("The body is not application/json."),
}
SESSION_ID = "$response.body#/sessionId"
TURN_ID = "$response.header.AAP-Turn-Id"
LINKS = {
    ("/v1/sessions", "post", "201"): {
        "GetSession": {"operationId": "getSession", "parameters": {"session_id": SESSION_ID}},
        "GetHistory": {"operationId": "getHistory", "parameters": {"session_id": SESSION_ID}},
        "SendTurn": {"operationId": "sendTurn", "parameters": {"session_id": SESSION_ID}},
        "DeleteSession": {"operationId": "deleteSession", "parameters": {"session_id": SESSION_ID}},
    },
    ("/v1/sessions/{session_id}/turns", "post", "200"): {
        "ReattachTurn": {
            "operationId": "reattachTurn",
            "parameters": {"session_id": "$request.path.session_id", "turn_id": TURN_ID},
        },
        "CancelTurn": {
            "operationId": "cancelTurn",
            "parameters": {"session_id": "$request.path.session_id", "turn_id": TURN_ID},
        },
    },
}
# Open API before 3.2 has an event stream's `schema` describe each event.
SSE = {"schema": {"$ref": "#/components/schemas/TurnEvent"}}
# PUT /v2/session's stream: `session_start` (no id:) before the turn's events.
V2_SSE = {
    "schema": {
        "oneOf": [
            {
                "type": "object",
                "required": ["event", "data"],
                "properties": {
                    "event": {"type": "string", "enum": ["session_start"]},
                    "data": {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"$ref": "#/components/schemas/V2SessionStartEvent"},
                    },
                },
            },
            {"$ref": "#/components/schemas/TurnEvent"},
        ]
    }
}
TURN_ID_HEADER = {"AAP-Turn-Id": {"schema": {"type": "string"}, "required": True, "description": "The turn's id."}}


# Request bodies that work when sent unchanged from /v1/docs (with the demo tenant's `echo`).
EXAMPLES = {
    ("/v1/sessions", "post"): {
        "echo": {"summary": "A session of the demo echo agent", "value": {"agent": {"name": "echo"}}},
        "seeded": {
            "summary": "With options and a seed history",
            "value": {
                "agent": {"name": "echo", "options": {"style": "upper"}},
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "echo: Hi"},
                ],
            },
        },
    },
    ("/v1/sessions/{session_id}/turns", "post"): {
        "json": {
            "summary": "One user message, answer as JSON",
            "value": {"messages": [{"role": "user", "content": "Hello"}]},
        },
        "stream": {
            "summary": "Streamed as deltas (SSE)",
            "value": {"stream": "delta", "messages": [{"role": "user", "content": "Hello"}]},
        },
    },
}
EXAMPLES[("/v2/session", "put")] = {
    "json": {
        "summary": "A session of the demo echo agent and its first turn, answered as JSON",
        "value": {"agent": {"name": "echo"}, "messages": [{"role": "user", "content": "Hello"}]},
    },
    "stream": {
        "summary": "Streamed as deltas (SSE, session_start first)",
        "value": {"agent": {"name": "echo"}, "stream": "delta", "messages": [{"role": "user", "content": "Hello"}]},
    },
}
EXAMPLES[("/v2/session/{session_id}", "post")] = EXAMPLES[("/v1/sessions/{session_id}/turns", "post")]
META_PROPERTY = {"type": "object", "additionalProperties": True, "description": "Extra data the server ignores."}


def postprocess(result, generator, request, public):
    """SPECTACULAR_SETTINGS["POSTPROCESSING_HOOKS"]: complete the generated document."""
    from sessions_app.api.v2.shapes import WIRE_SCHEMAS as V2_WIRE_SCHEMAS
    from sessions_app.protocol import WIRE_SCHEMAS

    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in schemas.items():
        # Request shapes are protocol.StrictSerializer: `_meta` allowed, nothing else undeclared.
        if name.endswith("Request") and schema.get("type") == "object":
            schema.setdefault("properties", {})["_meta"] = META_PROPERTY
            schema["additionalProperties"] = False
    schemas.update(WIRE_SCHEMAS)
    schemas.update(V2_WIRE_SCHEMAS)
    for key, examples in EXAMPLES.items():
        body = result["paths"].get(key[0], {}).get(key[1], {}).get("requestBody")
        if body:
            body["content"]["application/json"]["examples"] = examples
    for path, item in result.get("paths", {}).items():
        for method, operation in item.items():
            operation["operationId"] = OPERATION_IDS.get((path, method), operation.get("operationId"))
            responses = operation.setdefault("responses", {})
            for status, answer in COMMON_ERRORS.items():
                responses.setdefault(status, answer)
            if "requestBody" in operation:
                for status, answer in BODY_ERRORS.items():
                    responses.setdefault(status, answer)
            for (link_path, link_method, status), links in LINKS.items():
                if (path, method) == (link_path, link_method):
                    responses[status]["links"] = links
    turns = result["paths"].get("/v1/sessions/{session_id}/turns", {}).get("post")
    if turns:
        ok = turns["responses"]["200"]
        ok["content"]["text/event-stream"] = SSE
        ok["headers"] = TURN_ID_HEADER
    for path in ("/v2/session", "/v2/session/{session_id}"):
        operation = result["paths"].get(path, {}).get("put" if path == "/v2/session" else "post")
        if operation:
            ok = operation["responses"]["200"]
            ok.setdefault("content", {})["text/event-stream"] = V2_SSE if path == "/v2/session" else SSE
            ok["headers"] = TURN_ID_HEADER
            if path == "/v2/session":
                operation["responses"]["201"]["headers"] = TURN_ID_HEADER
    for path in ("/v1/sessions/{session_id}/turns/{turn_id}/events", "/v2/session/{session_id}/turns/{turn_id}/events"):
        events = result["paths"].get(path, {}).get("get")
        if events:
            events["responses"]["200"] = {
                "description": "The turn's events after Last-Event-ID, then live ones until turn_stop.",
                "content": {"text/event-stream": SSE},
                "headers": TURN_ID_HEADER,
            }
    return result
