from django.apps import AppConfig


class SessionsAppConfig(AppConfig):
    name = "sessions_app"
    verbose_name = "AAP sessions"

    def ready(self) -> None:
        from hosting import metrics

        from .queue_metrics import QueueCollector

        metrics.register_collector(QueueCollector())
