import json

from django.core.management.base import BaseCommand, CommandError

from agents.services import AgentFileError, load_registry_file, mcp_refresh, registry_apply


class Command(BaseCommand):
    help = "Create or update tenants (their limits) and agents (options, server tools) from a JSON or YAML file (idempotent)."

    def add_arguments(self, parser):
        parser.add_argument(
            "file", help="a .json, .yaml or .yml file: a list of agents or {tenants: [...], agents: [...]}"
        )
        parser.add_argument("--prune", action="store_true", help="remove agents the file no longer lists")

    def handle(self, *args, file, prune, **options):
        try:
            report = registry_apply(load_registry_file(file), prune=prune)
        except FileNotFoundError:
            raise CommandError(f"No such file: {file}") from None
        except AgentFileError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(json.dumps(report))
        # The agents' MCP servers list their tools now (not at the first /meta or turn).
        for name in report.get("created", []) + report.get("updated", []):
            for line in mcp_refresh(name):
                self.stderr.write(line)
