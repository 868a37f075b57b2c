from django.core.management.base import BaseCommand, CommandError

from infra.crypto import SecretDecryptionError
from sessions_app.api.services.secrets import secrets_rotate


class Command(BaseCommand):
    help = (
        "Re-encrypt every stored secret (secret option defaults and session values) with the "
        "first key of HOSTING_ENCRYPTION_KEYS, so older keys can then be removed."
    )

    def handle(self, *args, **options):
        try:
            count = secrets_rotate()
        except SecretDecryptionError as exc:
            raise CommandError(f"{exc}; put every key still in use into HOSTING_ENCRYPTION_KEYS.") from None
        self.stdout.write(f"Re-encrypted {count} secret value(s) with the current key.")
