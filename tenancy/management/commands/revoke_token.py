from django.core.management.base import BaseCommand, CommandError

from tenancy.services import TokenNotFound, token_revoke


class Command(BaseCommand):
    help = "Revoke the API token with this visible prefix (e.g. aap_1a2b3c4d)."

    def add_arguments(self, parser):
        parser.add_argument("prefix")

    def handle(self, *args, prefix, **options):
        try:
            token = token_revoke(prefix=prefix)
        except TokenNotFound as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"Revoked {token.prefix} of tenant '{token.tenant}'.")
