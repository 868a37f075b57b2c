from django.core.management.base import BaseCommand
from django.db import transaction

from agents.services import ECHO_AGENT, agents_apply
from hosting.models import Tenant
from hosting.services import token_create


class Command(BaseCommand):
    help = "Create the demo tenant and the echo agent (idempotent); prints a demo token as the last line."

    def add_arguments(self, parser):
        parser.add_argument("--assistant", action="store_true",
                            help="also register 'assistant' (openai runtime) from OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL")

    def handle(self, *args, assistant=False, **options):
        entries = [ECHO_AGENT]
        if assistant:
            from agents.services import assistant_agent_entry

            entries.append(assistant_agent_entry())
        with transaction.atomic():
            tenant, _ = Tenant.objects.get_or_create(name="demo", defaults={"title": "Demo tenant"})
            agents_apply(entries)
            _, raw = token_create(tenant=tenant, name="seed_demo")
        self.stdout.write(f"Agents ready: {', '.join(a['name'] for a in entries)}. Tenant: demo.")
        self.stdout.write(raw)
