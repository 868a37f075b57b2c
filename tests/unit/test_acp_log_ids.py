"""Log lines about an agent process (its exit, its limits, its idle stop) carry the ids of
its own unit, never those of the turn that happened to start it or be running: a process
outlives its first turn, and a tenant's unit serves several sessions."""

from __future__ import annotations

from pathlib import Path

from agents.runtimes.acp_bridge import limits, sandbox
from agents.runtimes.acp_bridge.process import AgentProcess, ProcessSpec
from infra.logs import current_log_context, log_context


def process_of(unit: str) -> AgentProcess:
    box = sandbox.SandboxSpec(
        unit=unit, writable=(Path("/nowhere"),), read_paths=(), egress=(), limits=limits.Limits.parse(None)
    )
    return AgentProcess(ProcessSpec(key="k", label="a/t/k", argv=("agent",), env={}, sandbox=box))


def test_a_session_units_log_ids_are_its_tenant_and_session_only():
    process = process_of("session:acme/sess_mine")
    with log_context(tenant="other", session="sess_theirs", turn="turn_theirs"):
        context = process.log_context()
    assert context.run(current_log_context) == {"tenant": "acme", "session": "sess_mine"}


def test_a_tenant_units_log_ids_name_no_session():
    process = process_of("tenant:acme/0123456789abcdef")
    with log_context(tenant="acme", session="sess_first", turn="turn_first"):
        context = process.log_context()
    assert context.run(current_log_context) == {"tenant": "acme"}
    assert process.log_ids() == {"tenant": "acme", "session": None}
