from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from hosting.models import Tenant
from hosting.services import token_create


class Command(BaseCommand):
    help = "Create a new API token for a tenant and print it (the last line of the output)."

    def add_arguments(self, parser):
        parser.add_argument("tenant_name")
        parser.add_argument("--name", default="", help="a label for the token")
        parser.add_argument("--expires-in-days", type=int, default=None)

    def handle(self, *args, tenant_name, name, expires_in_days, **options):
        tenant = Tenant.objects.filter(name=tenant_name).first()
        if tenant is None:
            raise CommandError(f"No tenant named '{tenant_name}'; create it with create_tenant {tenant_name}.")
        expires = timezone.now() + timedelta(days=expires_in_days) if expires_in_days else None
        token, raw = token_create(tenant=tenant, name=name, expires_at=expires)
        self.stdout.write(f"Created token {token.prefix} for '{tenant.name}' (shown once):")
        self.stdout.write(raw)
