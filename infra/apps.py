from django.apps import AppConfig


class InfraConfig(AppConfig):
    """Installed for its management commands (check_database, grant_worker_role); no models."""

    name = "infra"
    verbose_name = "Platform"
