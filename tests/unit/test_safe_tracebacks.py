"""Failures are logged with their traceback (every frame: file, line, function) and never
with an exception's message, which may carry a secret (infra/logs.py)."""

from __future__ import annotations

import io
import json
import logging
import sys
import traceback

import pytest

from infra.logs import PlainFormatter, TaskFailureFilter, format_exception_safely, json_formatter

SECRET = "sk-live-0123456789abcdef0123456789abcdef"


def _query_with_parameters(key: str) -> None:
    raise TypeError(f"unsupported operand type(s): 'NoneType' and 'str' (apiKey={key})")


def _store_turn(key: str) -> None:
    try:
        _query_with_parameters(key)
    except TypeError as exc:
        raise RuntimeError(f"could not store {key}") from exc


def _log_failure(formatter: logging.Formatter, name: str) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    logger = logging.getLogger(f"tests.safe_tracebacks.{name}")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        try:
            _store_turn(SECRET)
        except RuntimeError:
            logger.exception("turn %s could not be stored", "turn_1")
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def test_the_standard_formatter_would_leak_the_secret():
    """Positive control: what logging does by default puts the message in the log."""
    assert SECRET in _log_failure(logging.Formatter("%(message)s"), "standard")


@pytest.mark.parametrize("kind", ["json", "plain"])
def test_a_logged_failure_keeps_every_frame_and_no_message(kind):
    formatter = json_formatter() if kind == "json" else PlainFormatter("%(levelname)s %(message)s")
    text = _log_failure(formatter, kind)
    trace = json.loads(text)["exc_info"] if kind == "json" else text
    assert SECRET not in text and SECRET[8:24] not in text
    assert "turn turn_1 could not be stored" in text
    assert trace.count("Traceback (most recent call last):") == 2
    for function in ("_log_failure", "_store_turn", "_query_with_parameters"):
        assert f", in {function}\n" in trace, function
    assert f'File "{__file__}", line ' in trace
    assert "TypeError (message withheld)" in trace
    assert "The above exception was the direct cause of the following exception" in trace
    assert trace.rstrip().endswith("RuntimeError (message withheld)")


def test_a_traceback_another_formatter_cached_is_rendered_again():
    """A record formatted first by a plain logging.Formatter caches its traceback, with the
    message, on the record (exc_text): the service's formatters never reuse it."""
    try:
        _store_turn(SECRET)
    except RuntimeError:
        record = logging.getLogger("tests").makeRecord(
            "tests", logging.ERROR, __file__, 1, "failed", (), exc_info=sys.exc_info()
        )
    assert SECRET in logging.Formatter().format(record) and SECRET in record.exc_text
    assert SECRET not in PlainFormatter().format(record)
    assert SECRET not in json_formatter().format(record)


def test_exception_groups_show_each_member_without_its_message():
    try:
        raise ExceptionGroup(f"task group {SECRET}", [KeyError(SECRET), ConnectionError(f"to {SECRET}")])
    except ExceptionGroup as group:
        text = format_exception_safely(group)
    assert SECRET not in text
    assert "ExceptionGroup (message withheld)" in text
    assert "| KeyError (message withheld)" in text and "| ConnectionError (message withheld)" in text
    assert "in test_exception_groups_show_each_member_without_its_message" in text


def test_a_module_level_exception_type_is_named_with_its_module():
    class ServiceBroke(Exception):
        pass

    try:
        raise ServiceBroke(SECRET)
    except ServiceBroke as exc:
        text = format_exception_safely(exc)
    assert text.endswith(f"{__name__}.{ServiceBroke.__qualname__} (message withheld)")
    assert SECRET not in text


def test_celery_task_failures_lose_the_quoted_message_and_keep_the_frames():
    """Celery logs a task that raised with the exception's repr in its line and the rendered
    traceback as an extra (`data`): the service's filter withholds both."""
    from celery.app.trace import LOG_FAILURE

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(json_formatter())
    handler.addFilter(TaskFailureFilter())
    logger = logging.getLogger("celery.app.trace")
    logger.addHandler(handler)
    try:
        try:
            _store_turn(SECRET)
        except RuntimeError as exc:
            context = {
                "hostname": "w1",
                "id": "5f1",
                "name": "agents.tasks.list_mcp_tools",
                "exc": repr(exc),
                "traceback": "".join(traceback.format_exception(exc)),
                "args": f"({SECRET!r},)",
                "kwargs": "{}",
                "description": "raised unexpected",
                "internal": False,
            }
            assert SECRET in context["exc"] and SECRET in context["traceback"]  # positive control
            logger.log(logging.ERROR, LOG_FAILURE.strip(), context, exc_info=sys.exc_info(), extra={"data": context})
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    line = json.loads(text)
    assert SECRET not in text and SECRET[8:24] not in text
    assert line["message"] == (
        "Task agents.tasks.list_mcp_tools[5f1] raised unexpected: RuntimeError (message withheld)"
    )
    assert ", in _store_turn\n" in line["exc_info"] and ", in _query_with_parameters\n" in line["exc_info"]
