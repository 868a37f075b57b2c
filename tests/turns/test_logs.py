"""Structured logs: JSON lines carrying the tenant, session and turn of the work at hand,
and the routine sweep kept out of INFO."""

from __future__ import annotations

import json
import logging
import logging.config
import time

from infra.logs import bind_log_context, current_log_context, log_context


def test_lines_about_a_turn_carry_its_ids_and_others_do_not(captured):
    log = logging.getLogger("sessions_app.engine.host")
    with log_context(turn="turn_abc"):
        bind_log_context(tenant="demo", session="sess_xyz")
        log.warning("server tool %s failed: %s", "clock", "TimeoutError")
        with log_context(turn="turn_inner"):
            log.info("nested")
    log.info("outside")
    lines = captured()
    assert lines[0] == {
        **lines[0],
        "level": "WARNING",
        "logger": "sessions_app.engine.host",
        "tenant": "demo",
        "session": "sess_xyz",
        "turn": "turn_abc",
        "message": "server tool clock failed: TimeoutError",
    }
    assert "time" in lines[0]
    assert lines[1]["turn"] == "turn_inner" and lines[1]["session"] == "sess_xyz"
    assert lines[2]["message"] == "outside" and not {"tenant", "session", "turn"} & set(lines[2])
    assert current_log_context() == {}


def test_the_routine_sweep_logs_at_debug_only(captured):
    logging.getLogger("celery.beat").info(
        "Scheduler: Sending due task sweep-stale-turns (sessions_app.tasks.sweep_stale_turns)"
    )
    logging.getLogger("celery.worker.strategy").info("Task sessions_app.tasks.sweep_stale_turns[1f] received")
    logging.getLogger("celery.app.trace").info("Task sessions_app.tasks.sweep_stale_turns[1f] succeeded in 0.01s: 0")
    logging.getLogger("celery.app.trace").info("Task sessions_app.tasks.run_turn[2a] succeeded in 0.2s: None")
    logging.getLogger("sessions_app.engine.recovery").warning("turn turn_q was lost (running); ended with error")
    assert [line["message"] for line in captured()] == [
        "Task sessions_app.tasks.run_turn[2a] succeeded in 0.2s: None",
        "turn turn_q was lost (running); ended with error",
    ]


def test_a_failing_turn_is_logged_by_the_worker_with_its_ids(demo, captured):
    session_id = demo.create_session("echo")
    result = demo.turn(session_id, text="/error")
    assert result.stop_reason == "error"
    # The worker thread may log just after the stream ended.
    deadline = time.monotonic() + 30
    while not (mine := [line for line in captured() if line.get("turn") == result.turn_id]):
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert mine, "the worker logged the failed turn with its id"
    for line in mine:
        assert line["session"] == session_id and line["tenant"] == "demo", line
    assert any(line["level"] == "ERROR" and result.turn_id in line["message"] for line in mine)


def test_a_code_bug_in_a_service_is_logged_with_its_frames_and_no_secret(demo, captured, monkeypatch):
    """A TypeError inside a service (a code bug, not an outage): the request's boundary logs
    it with the request's ids and a traceback down to the failing frame, without the
    exception's message, which here quotes a secret; the client gets a JSON 500."""
    from sessions_app.api.services import sessions

    secret = "sk-live-" + "5e" * 16

    def _session_create(**kwargs):
        raise TypeError(f"can only concatenate str (not 'NoneType') to str: {secret}")

    monkeypatch.setattr(sessions, "_session_create", _session_create)
    response = demo.post("/v1/sessions", {"agent": {"name": "echo", "options": {"apiKey": secret}}})
    assert response.status_code == 500 and secret not in response.text
    assert "it was logged" in response.json()["error"]
    lines = [line for line in captured() if line["level"] == "ERROR" and "exc_info" in line]
    assert lines, "the failure was logged with its traceback"
    line = lines[-1]
    assert line["message"] == "unhandled error in SessionsView" and line["tenant"] == "demo"
    trace = line["exc_info"]
    assert trace.startswith("Traceback (most recent call last):")
    assert "sessions_app/api/services/sessions.py" in trace and ", in session_create\n" in trace
    assert ", in _session_create\n" in trace and "test_logs.py" in trace
    assert trace.endswith("TypeError (message withheld)")
    assert secret not in json.dumps(captured())


def test_a_code_bug_in_a_turn_is_logged_with_its_ids_frames_and_no_secret(demo, captured, monkeypatch):
    """A TypeError inside a runtime while a turn runs: the turn ends with an error, and the
    turn's boundary logs it with the tenant, session and turn, and the frames down to the
    runtime, without the message (it quotes a secret)."""
    from agents.runtimes.echo import EchoRuntime

    secret = "sk-live-" + "7c" * 16

    async def run(self, ctx):
        raise TypeError(f"'NoneType' object is not subscriptable (key={secret})")

    monkeypatch.setattr(EchoRuntime, "run", run)
    session_id = demo.create_session("echo")
    result = demo.turn(session_id, text="hi")
    assert result.stop_reason == "error"
    deadline = time.monotonic() + 30
    while not (mine := [line for line in captured() if line.get("turn") == result.turn_id and "exc_info" in line]):
        assert time.monotonic() < deadline, "the failed turn was never logged with its traceback"
        time.sleep(0.1)
    [line] = mine
    assert line["level"] == "ERROR" and line["session"] == session_id and line["tenant"] == "demo"
    trace = line["exc_info"]
    assert "sessions_app/engine/host.py" in trace and ", in run\n" in trace and "test_logs.py" in trace
    assert trace.endswith("TypeError (message withheld)")
    assert secret not in json.dumps(captured())
