from django.apps import AppConfig


class HostingConfig(AppConfig):
    name = "hosting"
    verbose_name = "Tenancy"

    def ready(self):
        from hosting import openapi  # noqa: F401  (registers the bearer scheme of the OpenAPI document)
