"""The declarative agents file (agents.services.agents_apply): an entry it cannot apply is
refused with an AgentFileError naming the agent and the field, never another exception."""

from __future__ import annotations

import uuid

import pytest


@pytest.mark.parametrize("implementation", [None, 7, ["clock"], {"name": "clock"}])
def test_a_server_tool_whose_implementation_is_not_a_name_is_refused(implementation):
    from agents.models import Agent
    from agents.services import AgentFileError, agents_apply

    name = f"file-{uuid.uuid4().hex[:6]}"
    tool = {"name": "now", "description": "The time.", "implementation": implementation}
    with pytest.raises(AgentFileError, match=f"Agent '{name}': server tool 'now': 'implementation'"):
        agents_apply([{"name": name, "runtime": {"kind": "echo"}, "tools": [tool]}])
    assert not Agent.objects.filter(name=name).exists()
