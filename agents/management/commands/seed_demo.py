from django.core.management.base import BaseCommand

from agents.demo import demo_seed


class Command(BaseCommand):
    help = (
        "Create the demo tenant and the echo agent when they are absent (an operator's edits are kept); "
        "prints a demo token as the last line, the same one on every run while it stays valid."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--assistant",
            action="store_true",
            help="also register 'assistant' (openai runtime) from OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL",
        )
        parser.add_argument(
            "--no-token",
            action="store_true",
            help="only the tenant and agents; no token is printed (e.g. in a container: use create_token demo)",
        )

    def handle(self, *args, assistant=False, no_token=False, **options):
        result = demo_seed(assistant=assistant, token=not no_token)
        if result.created:
            self.stdout.write(f"Created: {', '.join(result.created)}.")
        if result.kept:
            self.stdout.write(f"Kept as they are (delete them in admin to re-seed): {', '.join(result.kept)}.")
        if no_token:
            return
        if result.token_reused:
            self.stdout.write(f"Demo token: the one kept in {result.token_file} (delete that file for a new one).")
        else:
            self.stdout.write(
                f"Demo token: a new one, kept in {result.token_file}"
                + (f"; {result.revoked} earlier demo token(s) revoked." if result.revoked else ".")
            )
        self.stdout.write(result.token)
