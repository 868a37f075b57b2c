"""Key rotation: every stored secret (secret option defaults, sessions' secret option values)
re-encrypted with the first key of HOSTING_ENCRYPTION_KEYS."""

from __future__ import annotations

from django.db import transaction

from agents.models import AgentOption
from infra import crypto
from sessions_app.models import Session


@transaction.atomic
def secrets_rotate() -> int:
    """Re-encrypt every stored secret with the first configured key; returns how many."""
    count = 0
    for option in AgentOption.objects.select_for_update().filter(type=AgentOption.SECRET).exclude(default=""):
        option.default = crypto.rotate(option.default)
        option.save(update_fields=["default"])
        count += 1
    secret_names: dict[int, set[str]] = {}
    for agent_id, name in AgentOption.objects.filter(type=AgentOption.SECRET).values_list("agent_id", "name"):
        secret_names.setdefault(agent_id, set()).add(name)
    sessions = Session.objects.select_for_update().filter(agent_id__in=secret_names).only("options", "agent_id")
    for session in sessions.iterator():
        names = secret_names[session.agent_id] & set(session.options)
        if names:
            session.options = {k: crypto.rotate(v) if k in names else v for k, v in session.options.items()}
            session.save(update_fields=["options"])
            count += len(names)
    return count
