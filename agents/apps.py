from django.apps import AppConfig


class AgentsConfig(AppConfig):
    name = "agents"
    verbose_name = "Agent registry"

    def ready(self):
        from . import mcp_registry as registry
        from . import signals  # noqa: F401
        from .mcp import tools_listed

        tools_listed.connect(registry.on_tools_listed, weak=False, dispatch_uid="agents.mcp_registry")
