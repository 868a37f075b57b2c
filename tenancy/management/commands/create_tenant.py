from django.core.management.base import BaseCommand, CommandError
from django.db import IntegrityError

from tenancy.services import tenant_create


class Command(BaseCommand):
    help = "Create a tenant and print a new API token for it (the last line of the output)."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("--title", default="")

    def handle(self, *args, name, title, **options):
        try:
            tenant, raw = tenant_create(name=name, title=title)
        except IntegrityError:
            raise CommandError(f"A tenant named '{name}' exists; use create_token {name}.") from None
        self.stdout.write(f"Created tenant '{tenant.name}'. Its API token (shown once):")
        self.stdout.write(raw)
