"""Tenancy services: create tenants and tokens, revoke tokens."""

from datetime import datetime

from django.db import transaction
from django.utils import timezone

from . import crypto

from .models import ApiToken, Tenant


class TokenNotFound(Exception):
    pass


def token_create(*, tenant: Tenant, name: str = "", expires_at: datetime | None = None) -> tuple[ApiToken, str]:
    """Create a token; returns the row and the raw token (shown once, never stored)."""
    raw, prefix, digest = ApiToken.generate()
    token = ApiToken.objects.create(
        tenant=tenant, name=name, prefix=prefix, token_hash=digest, expires_at=expires_at
    )
    return token, raw


@transaction.atomic
def tenant_create(*, name: str, title: str = "") -> tuple[Tenant, str]:
    tenant = Tenant.objects.create(name=name, title=title)
    _, raw = token_create(tenant=tenant, name="initial")
    return tenant, raw


def token_revoke(*, prefix: str) -> ApiToken:
    token = ApiToken.objects.filter(prefix=prefix).first()
    if token is None:
        raise TokenNotFound(f"No token has the prefix {prefix!r}.")
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
    return token


@transaction.atomic
def secrets_rotate() -> int:
    """Re-encrypt every stored secret with the first configured key; returns how many."""
    from agents.models import AgentOption
    from sessions_app.models import Session

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
