from django.apps import AppConfig


class AgentsConfig(AppConfig):
    name = "agents"
    verbose_name = "Agent registry"

    def ready(self):
        from . import signals  # noqa: F401
