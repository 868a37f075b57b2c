from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from tenancy.models import Tenant
from tenancy.services import token_create


class Command(BaseCommand):
    help = "Create a new API token for a tenant and print it (the last line of the output)."

    def add_arguments(self, parser):
        parser.add_argument("tenant_name")
        parser.add_argument("--name", default="", help="a label for the token")
        parser.add_argument(
            "--expires-in-days", type=int, default=None, help="days until the token expires (1 or more; omit for never)"
        )

    def handle(self, *args, tenant_name, name, expires_in_days, **options):
        tenant = Tenant.objects.filter(name=tenant_name).first()
        if tenant is None:
            raise CommandError(f"No tenant named '{tenant_name}'; create it with create_tenant {tenant_name}.")
        if expires_in_days is not None and expires_in_days < 1:
            # 0 used to mean "never" by accident; a token that never expires is made by omitting the option.
            raise CommandError("--expires-in-days must be 1 or more; omit it for a token that never expires.")
        expires = timezone.now() + timedelta(days=expires_in_days) if expires_in_days is not None else None
        token, raw = token_create(tenant=tenant, name=name, expires_at=expires)
        self.stdout.write(f"Created token {token.prefix} for '{tenant.name}' (shown once):")
        self.stdout.write(raw)
