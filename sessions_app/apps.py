from django.apps import AppConfig


class SessionsAppConfig(AppConfig):
    name = "sessions_app"
    verbose_name = "AAP sessions"

    def ready(self) -> None:
        from infra import metrics

        from .engine.queue import QueueCollector

        metrics.register_collector(QueueCollector())
