"""Celery tasks of the agent registry: thin, safe to run twice; the logic is in mcp_registry."""

from celery import shared_task

from . import mcp_registry as registry


@shared_task(name=registry.LIST_TASK, ignore_result=True)
def list_mcp_tools(agent_id: int) -> None:
    """List an agent's MCP servers in this worker (the web never starts a stdio server)."""
    registry.list_in_worker(agent_id)
