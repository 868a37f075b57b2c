"""Structured logs: one JSON object per line, carrying the tenant, session and turn of the
work at hand (from contextvars, so every line a turn's code logs has them without passing
them along), and Celery's routine lines about the periodic sweep moved to DEBUG.

Used by the LOGGING block of hosting/settings.py; LOG_FORMAT=plain gives text lines with
the same ids for a terminal.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from pythonjsonlogger.json import JsonFormatter

#: The ids of the work at hand: any of tenant, session, turn.
_ids: ContextVar[dict[str, str]] = ContextVar("aap_log_ids", default={})  # noqa: B039 (replaced, never mutated)

ID_FIELDS = ("tenant", "session", "turn")
# Periodic tasks whose every run would otherwise log three INFO lines (beat, received, succeeded).
ROUTINE_TASKS = ("sessions_app.tasks.sweep_stale_turns", "sweep-stale-turns")


def _clean(ids: dict) -> dict[str, str]:
    return {key: str(value) for key, value in ids.items() if key in ID_FIELDS and value}


@contextmanager
def log_context(**ids: str | None) -> Iterator[None]:
    """Tag every log line inside the block with these ids (tenant=, session=, turn=)."""
    token = _ids.set({**_ids.get(), **_clean(ids)})
    try:
        yield
    finally:
        _ids.reset(token)


def bind_log_context(**ids: str | None) -> None:
    """Add ids to the current context, until the enclosing `log_context` block ends."""
    _ids.set({**_ids.get(), **_clean(ids)})


def reset_log_context(**ids: str | None) -> None:
    """Make `ids` the whole log context of this context (nothing inherited)."""
    _ids.set(_clean(ids))


def current_log_context() -> dict[str, str]:
    return dict(_ids.get())


class ContextFilter(logging.Filter):
    """Copies the context's ids onto each record (extra fields of the JSON line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _ids.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class RoutineTaskFilter(logging.Filter):
    """Demotes Celery's INFO lines about routine periodic tasks to DEBUG (dropped unless the
    root logger is at DEBUG); a sweep that ends a lost turn still logs its own warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not record.name.startswith("celery"):
            return True
        try:
            text = record.getMessage()
        except Exception:  # a malformed record is not this filter's business
            return True
        if not any(name in text for name in ROUTINE_TASKS):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().isEnabledFor(logging.DEBUG)


class PlainFormatter(logging.Formatter):
    """Text lines for a terminal, with the ids appended as key=value."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = " ".join(f"{key}={getattr(record, key)}" for key in ID_FIELDS if getattr(record, key, None))
        return f"{line} {ids}" if ids else line


def json_formatter() -> JsonFormatter:
    """The JSON-lines formatter: time, level, logger, message, then the ids and any extras."""
    return JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        datefmt="%Y-%m-%dT%H:%M:%S%z",
    )


def describe_failure(exc: BaseException) -> str:
    """An exception's type and where it was raised, never its message: messages can carry
    values (SQL parameters, provider payloads) that must not reach a log."""
    frames = traceback.extract_tb(exc.__traceback__)[-4:]
    where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))
    return f"{type(exc).__name__} at {where}"
