from django.apps import AppConfig


class TenancyConfig(AppConfig):
    name = "tenancy"
    # The label these models were created under, when they lived in the `hosting` package: it
    # names their tables (hosting_tenant, hosting_apitoken), their rows in django_migrations,
    # their content types and permissions, the admin's URLs and the other apps' foreign keys
    # ("hosting.Tenant"), so existing databases keep working without a migration.
    label = "hosting"
    verbose_name = "Tenancy"
