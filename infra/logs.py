"""Structured logs: one JSON object per line, carrying the tenant, session and turn of the
work at hand (from contextvars, so every line a turn's code logs has them without passing
them along), and Celery's routine lines about the periodic sweep moved to DEBUG.

Failures are logged with `logger.exception(...)` or `exc_info=True` like anywhere else: both
formatters here render a traceback as its frames (file, line, function and source line of
every frame, chained and grouped exceptions included) and each exception's type, never its
message nor any local variable: messages carry values (SQL parameters, provider payloads,
keys) that must not reach a log.

Used by the LOGGING block of hosting/settings.py; LOG_FORMAT=plain gives text lines with
the same ids for a terminal.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import TracebackType
from typing import Any

from pythonjsonlogger.json import JsonFormatter

#: The ids of the work at hand: any of tenant, session, turn.
_ids: ContextVar[dict[str, str]] = ContextVar("aap_log_ids", default={})  # noqa: B039 (replaced, never mutated)

#: What `sys.exc_info()` returns, as logging passes it to a formatter.
ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None] | tuple[None, None, None]

ID_FIELDS = ("tenant", "session", "turn")
# Periodic tasks whose every run would otherwise log three INFO lines (beat, received, succeeded).
ROUTINE_TASKS = ("sessions_app.tasks.sweep_stale_turns", "sweep-stale-turns")


def _clean(ids: Mapping[str, object]) -> dict[str, str]:
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


def _type_name(exc: BaseException) -> str:
    kind = type(exc)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _frames_lines(exc: BaseException, seen: set[int], indent: str = "") -> list[str]:
    """The lines of one exception's traceback and of those chained to it, messages left out."""
    seen.add(id(exc))
    lines: list[str] = []
    cause, context = exc.__cause__, exc.__context__
    if cause is not None and id(cause) not in seen:
        lines += _frames_lines(cause, seen, indent)
        lines.append(f"{indent}\n{indent}The above exception was the direct cause of the following exception:\n\n")
    elif context is not None and not exc.__suppress_context__ and id(context) not in seen:
        lines += _frames_lines(context, seen, indent)
        lines.append(f"{indent}\n{indent}During handling of the above exception, another exception occurred:\n\n")
    if exc.__traceback__ is not None:
        lines.append(f"{indent}Traceback (most recent call last):\n")
        # Frames only: capture_locals stays off, and the source lines are the project's code.
        frames = traceback.extract_tb(exc.__traceback__)
        lines += [indent + line.replace("\n", "\n" + indent).rstrip(" ") for line in frames.format()]
    lines.append(f"{indent}{_type_name(exc)} (message withheld)\n")
    if isinstance(exc, BaseExceptionGroup):
        for number, inner in enumerate(exc.exceptions, 1):
            lines.append(f"{indent}+---------------- {number} ----------------\n")
            lines += _frames_lines(inner, seen, indent + "| ")
    return lines


def format_exception_safely(exc_info: ExcInfo | BaseException | None) -> str:
    """A traceback as frames and exception types, without messages or locals."""
    exc = exc_info[1] if isinstance(exc_info, tuple) else exc_info
    if exc is None:
        return ""
    return "".join(_frames_lines(exc, set())).rstrip("\n")


class TaskFailureFilter(logging.Filter):
    """Celery's line about a task that raised quotes the exception (`%(exc)s`, its repr) and
    attaches the rendered traceback (`data`): both carry the message. The line keeps the
    task's name and id and the exception's type; the traceback comes from `exc_info`, as
    frames (the formatters above)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("celery") or not isinstance(record.args, Mapping):
            return True
        if "exc" not in record.args and "traceback" not in record.args:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        kind = _type_name(exc) if exc is not None else "an exception"
        safe = {**record.args, "exc": f"{kind} (message withheld)", "traceback": "", "args": "", "kwargs": ""}
        record.args = safe
        if isinstance(getattr(record, "data", None), Mapping):
            setattr(record, "data", safe)  # noqa: B010 (an extra of Celery's, unknown to LogRecord)
        return True


class PlainFormatter(logging.Formatter):
    """Text lines for a terminal, with the ids appended as key=value; tracebacks as frames."""

    def format(self, record: logging.LogRecord) -> str:
        # Never reuse a traceback another formatter rendered (with its message) on this record.
        cached, record.exc_text = record.exc_text, None
        try:
            line = super().format(record)
        finally:
            record.exc_text = cached
        ids = " ".join(f"{key}={getattr(record, key)}" for key in ID_FIELDS if getattr(record, key, None))
        return f"{line} {ids}" if ids else line

    def formatException(self, ei: ExcInfo) -> str:
        return format_exception_safely(ei)


class SafeJsonFormatter(JsonFormatter):
    """python-json-logger's formatter with the traceback (`exc_info`) rendered as frames."""

    def formatException(self, ei: ExcInfo) -> str:
        return format_exception_safely(ei)

    def add_fields(self, log_record: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]) -> None:
        super().add_fields(log_record, record, message_dict)
        # A traceback another formatter cached on the record (exc_text) may hold a message.
        if "exc_info" in log_record:
            log_record["exc_info"] = format_exception_safely(record.exc_info) or "(traceback withheld)"


def json_formatter() -> JsonFormatter:
    """The JSON-lines formatter: time, level, logger, message, then the ids and any extras."""
    return SafeJsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        datefmt="%Y-%m-%dT%H:%M:%S%z",
    )
