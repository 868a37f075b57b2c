"""Checks of a session's or a turn's request against its agent: options (secrets encrypted),
server tools, client tools, images, stream mode, and answers to pending tool calls; and,
before any of them, of its size in items (`check_request_size`, and `check_body_size` on the
raw body before it is parsed into Python objects)."""

from __future__ import annotations

import re
from typing import Any

import simdjson
from django.conf import settings

from agents.models import Agent, AgentOption
from agents.selectors import AgentDefinition, option_rows, server_tool_specs
from infra import crypto
from infra.service_errors import BadRequest
from sessions_app.protocol import content_images, image_kind


def check_request_size(data: Any, *, seed: bool) -> None:
    """Refuse a session's or turn's request with more messages, content parts or tools than
    the limits allow, before any serializer looks at one of them.

    Runs on the parsed JSON and costs one `len` per list: a body under AAP_MAX_BODY_BYTES can
    hold 200,000 tiny messages, which per-message validation would take seconds of the web's
    CPU to refuse. `seed`: the messages a session starts with (AAP_MAX_SEED_MESSAGES) rather
    than one turn's (AAP_MAX_TURN_MESSAGES). Wrong types are left to the serializers.
    """
    if not isinstance(data, dict):
        return
    messages = data.get("messages")
    if isinstance(messages, list):
        limit, name = (
            (settings.AAP_MAX_SEED_MESSAGES, "AAP_MAX_SEED_MESSAGES")
            if seed
            else (settings.AAP_MAX_TURN_MESSAGES, "AAP_MAX_TURN_MESSAGES")
        )
        if limit and len(messages) > limit:
            what = "A session's seed history" if seed else "One turn"
            raise BadRequest(
                f"{what} may hold at most {limit} messages ({name}); this request has {len(messages)}. "
                + ("Start the session with fewer messages." if seed else "Send fewer messages per turn.")
            )
        parts = settings.AAP_MAX_CONTENT_PARTS
        for index, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if parts and isinstance(content, list) and len(content) > parts:
                raise BadRequest(
                    f"messages[{index}] has {len(content)} content parts; at most {parts} are allowed "
                    "(AAP_MAX_CONTENT_PARTS)."
                )
    tools = data.get("tools")
    limit = settings.AAP_MAX_REQUEST_TOOLS
    if limit and isinstance(tools, list) and len(tools) > limit:
        raise BadRequest(
            f"A request may declare at most {limit} client tools (AAP_MAX_REQUEST_TOOLS); this one has {len(tools)}."
        )


# Below this many bytes the full parse costs well under a millisecond: no early count.
EARLY_COUNT_MIN_BYTES = 64 * 1024
# What `check_body_size` reads: an object, after JSON's own whitespace only (a leading byte
# order mark, which Python's decoder refuses and simdjson skips, leaves it to the full parse).
_JSON_OBJECT_START = re.compile(rb"[ \t\n\r]*\{")


def _unique_keys(obj: simdjson.Object) -> bool:
    # simdjson answers the first of repeated keys, Python's decoder keeps the last.
    keys = list(obj.keys())
    return len(set(keys)) == len(keys)


def _outline(raw: bytes, *, seed: bool) -> dict | None:
    """The lists `check_request_size` measures, as lists of the same lengths, read from the
    raw body without building its objects; None when only the full parse can say.

    simdjson validates the whole document (UTF-8, escapes, numbers, structure) and takes no
    document Python's decoder refuses; it refuses some that Python takes (integers past 64
    bits; lone UTF-16 surrogate escapes, which LimitedJSONParser then refuses on its own), and
    those go to the full parse. So an outline exists only for a body the full parse reads as the same
    lists. One exception: a body that also nests arrays or objects deeper than Python's
    decoder follows (about 900 levels in a request; simdjson takes 1024) is refused for its
    count rather than its depth.
    """
    limit = settings.AAP_MAX_SEED_MESSAGES if seed else settings.AAP_MAX_TURN_MESSAGES
    if not limit or not _JSON_OBJECT_START.match(raw):
        return None
    parser = simdjson.Parser()
    try:
        document = parser.parse(raw)
    except (ValueError, RuntimeError):  # not JSON, or JSON that simdjson does not take
        return None
    if not isinstance(document, simdjson.Object) or not _unique_keys(document):
        return None
    outline: dict[str, Any] = {}
    messages = document.get("messages")
    if isinstance(messages, simdjson.Array):
        count = len(messages)
        if count > limit or not settings.AAP_MAX_CONTENT_PARTS:
            outline["messages"] = [None] * count  # no message of it is read
        else:
            outline["messages"] = []
            for message in messages:
                if not isinstance(message, simdjson.Object):
                    outline["messages"].append(None)
                    continue
                if not _unique_keys(message):
                    return None
                content = message.get("content")
                parts = [None] * len(content) if isinstance(content, simdjson.Array) else None
                outline["messages"].append({"content": parts})
    tools = document.get("tools")
    if isinstance(tools, simdjson.Array):
        outline["tools"] = [None] * len(tools)
    return outline


def check_body_size(raw: bytes, *, seed: bool) -> None:
    """`check_request_size` on a raw UTF-8 JSON body, before it is parsed into Python objects.

    Building 200,000 dicts costs more than the web should spend on a request it refuses:
    simdjson reads the body into its own tape instead, and the lists are counted there.
    Refuses with the very sentence `check_request_size` gives on the parsed body, and only a
    body the full parse would accept (see `_outline`); any other body, and one under
    EARLY_COUNT_MIN_BYTES, goes on to the full parse and its checks unchanged.
    """
    if len(raw) < EARLY_COUNT_MIN_BYTES:
        return
    outline = _outline(raw, seed=seed)
    if outline is not None:
        check_request_size(outline, seed=seed)


def _declared_options(agent: Agent | AgentDefinition) -> dict[str, Any]:
    return {option.name: option for option in option_rows(agent)}


def merge_options(agent: Agent | AgentDefinition, stored: dict, incoming: dict) -> dict:
    """Validate option values and merge them over the stored ones (secrets encrypted)."""
    declared = _declared_options(agent)
    unknown = sorted(set(incoming) - set(declared))
    if unknown:
        names = ", ".join(declared) or "none"
        raise BadRequest(
            f"Unknown option {', '.join(repr(u) for u in unknown)} for agent '{agent.name}'; its options are: {names}.",
            details={"unknownOptions": unknown},
        )
    merged = dict(stored)
    for name, value in incoming.items():
        option = declared[name]
        if option.type == AgentOption.SELECT and value not in option.choices:
            raise BadRequest(
                f"Option '{name}' must be one of: {', '.join(option.choices)} (got {value!r}).",
            )
        if option.is_secret and value == crypto.REDACTED:
            continue  # the placeholder means: keep the value in effect (at creation: the default)
        if value == option.public_default():
            # The advertised default (what a UI pre-fills from /meta) means "the default":
            # the same as not sending the option, or going back to the default on a turn.
            merged.pop(name, None)
        elif option.is_secret:
            merged[name] = crypto.encrypt(value)
        else:
            merged[name] = value
    return merged


def redacted_options(agent: Agent | AgentDefinition, stored: dict) -> dict[str, str]:
    secret = {o.name for o in option_rows(agent) if o.is_secret}
    return {name: (crypto.REDACTED if name in secret else value) for name, value in stored.items()}


def validate_server_tools(agent: Agent | AgentDefinition, refs: list[dict]) -> list[dict]:
    exposed = {spec["name"] for spec in server_tool_specs(agent)}
    seen = set()
    for ref in refs:
        if ref["name"] not in exposed:
            raise BadRequest(
                f"Agent '{agent.name}' exposes no server tool named '{ref['name']}'; "
                f"see GET /v1/meta (it exposes: {', '.join(sorted(exposed)) or 'none'}).",
            )
        if ref["name"] in seen:
            raise BadRequest(f"Server tool '{ref['name']}' is listed twice in agent.tools.")
        seen.add(ref["name"])
    return [{"name": ref["name"], "trust": bool(ref.get("trust", False))} for ref in refs]


def validate_client_tools(
    agent: Agent | AgentDefinition, tools: list[dict] | None, server_refs: list[dict] | None
) -> None:
    if tools is None:
        return
    if tools and "application" not in agent.capabilities():
        raise BadRequest(f"Agent '{agent.name}' does not accept client tools (capabilities.application.tools).")
    names = [tool["name"] for tool in tools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise BadRequest(f"Client tool names must be unique; repeated: {', '.join(duplicates)}.")
    collisions = sorted(set(names) & {ref["name"] for ref in server_refs or []})
    if collisions:
        raise BadRequest(
            f"Tool name collision: {', '.join(collisions)} is both a client tool and an enabled server tool."
        )


def check_images(agent: Agent | AgentDefinition, messages: list[dict]) -> None:
    supported = agent.capabilities().get("image", {})
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for block in content_images(content):
            kind = image_kind(block["url"])
            if kind not in supported:
                label = "https:// image URLs" if kind == "http" else "data: image URIs"
                raise BadRequest(f"Agent '{agent.name}' does not accept {label} (capabilities.image.{kind}).")


def check_stream(agent: Agent | AgentDefinition, mode: str) -> None:
    if mode not in agent.capabilities().get("stream", {}):
        modes = ", ".join(agent.capabilities().get("stream", {}))
        raise BadRequest(f"Agent '{agent.name}' does not support stream '{mode}'; it supports: {modes}.")


def answers_for_pending(pending: list[dict], messages: list[dict]) -> tuple[list[dict], list[dict]]:
    """Check a turn's messages against the pending calls; returns (tool messages, permissions)."""
    by_id = {call["toolCallId"]: call for call in pending}
    roles = [m["role"] for m in messages]
    history_only = sorted({role for role in roles if role not in ("user", "tool", "tool_permission")})
    if history_only:
        raise BadRequest(
            "A turn takes one user message, or one answer per pending tool call ('tool' or 'tool_permission'); "
            f"{' and '.join(repr(role) for role in history_only)} messages only seed the history a session is "
            "created with.",
        )
    if not pending:
        if roles != ["user"]:
            ids = [str(m.get("toolCallId")) for m in messages if m["role"] != "user"]
            if ids:
                raise BadRequest(
                    f"No tool calls are pending, so these answers match nothing: {', '.join(ids)}; "
                    "send one user message.",
                    details={"toolCallIds": ids},
                )
            raise BadRequest("Send exactly one user message per turn.")
        return [], []
    if "user" in roles:
        ids = list(by_id)
        raise BadRequest(
            f"Tool calls are pending ({', '.join(ids)}); answer each with a 'tool' message (client tools) "
            "or a 'tool_permission' message (server tools) before sending a user message.",
            details={"pendingToolCallIds": ids},
        )
    seen: set[str] = set()
    unknown, duplicate, wrong = [], [], []
    for message in messages:
        call_id = message["toolCallId"]
        call = by_id.get(call_id)
        if call is None:
            unknown.append(call_id)
        elif call_id in seen:
            duplicate.append(call_id)
        elif (message["role"] == "tool") != (call["kind"] == "client"):
            wrong.append(call_id)
        seen.add(call_id)
    missing = [call_id for call_id in by_id if call_id not in seen]
    problems = []
    if unknown:
        problems.append(f"unknown toolCallId {', '.join(unknown)}")
    if duplicate:
        problems.append(f"answered more than once: {', '.join(duplicate)}")
    if wrong:
        problems.append(
            f"wrong answer kind for {', '.join(wrong)} (client tools take a 'tool' message, "
            "server tools a 'tool_permission')"
        )
    if missing:
        problems.append(f"not answered: {', '.join(missing)}")
    if problems:
        raise BadRequest(
            "The messages must answer every pending tool call exactly once: " + "; ".join(problems) + ".",
            details={"unknown": unknown, "duplicate": duplicate, "wrongKind": wrong, "missing": missing},
        )
    tool_messages = [m for m in messages if m["role"] == "tool"]
    permissions = [
        {
            "toolCallId": m["toolCallId"],
            "name": by_id[m["toolCallId"]]["name"],
            "input": by_id[m["toolCallId"]].get("input", {}),
            "granted": m["granted"],
            "reason": m.get("reason") or None,
        }
        for m in messages
        if m["role"] == "tool_permission"
    ]
    return tool_messages, permissions
