"""Registry of runtime kinds: kind name -> Runtime class (imported lazily)."""

import logging
from functools import cache
from typing import TYPE_CHECKING

from django.utils.module_loading import import_string

RUNTIME_KINDS = {
    "echo": "agents.runtimes.echo.EchoRuntime",
    "acp": "agents.runtimes.acp_bridge.runtime.AcpRuntime",
    "openai": "agents.runtimes.openai.OpenAIRuntime",
}


def kind_choices() -> list[tuple[str, str]]:
    return [(kind, kind) for kind in RUNTIME_KINDS]


@cache
def runtime_class(kind: str):
    try:
        return import_string(RUNTIME_KINDS[kind])
    except KeyError:
        raise ValueError(f"Unknown runtime kind {kind!r}; choose one of {', '.join(RUNTIME_KINDS)}.") from None


if TYPE_CHECKING:
    from .base import Runtime

_instances: dict[str, "Runtime"] = {}


def runtime_for(kind: str):
    """The process-wide runtime instance of a kind (runtimes may keep per-process state)."""
    if kind not in _instances:
        _instances[kind] = runtime_class(kind)()
    return _instances[kind]


def shutdown_all() -> None:
    """The process is exiting: every runtime it used stops what it runs (each bounded)."""
    for runtime in list(_instances.values()):
        try:
            runtime.shutdown()
        except Exception:  # the exit's boundary: every other runtime still stops
            logging.getLogger(__name__).warning("stopping runtime %s failed", runtime.kind, exc_info=True)
