"""A framework-free Python SDK for AAP v3 (Agent Application Protocol): the wire types, the
fold of events into messages, SSE framing and parsing, a sync and an async client, and the
`aap` command line. It imports no web framework: servers and applications both build on it.
"""

from .client import AAPError, AsyncClient, Client, ToolRegistry, TurnResult, TurnStream
from .messages import fold
from .sse import SSEParser
from .types import EVENT_NAMES, HISTORY_TYPES, PROTOCOL_VERSION, STOP_REASONS, STREAM_MODES, Event

__all__ = [
    "EVENT_NAMES",
    "HISTORY_TYPES",
    "PROTOCOL_VERSION",
    "STOP_REASONS",
    "STREAM_MODES",
    "AAPError",
    "AsyncClient",
    "Client",
    "Event",
    "SSEParser",
    "ToolRegistry",
    "TurnResult",
    "TurnStream",
    "fold",
]
