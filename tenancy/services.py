"""Tenancy services: create tenants and tokens, revoke tokens."""

from datetime import datetime

from django.db import transaction
from django.utils import timezone

from .models import ApiToken, Tenant


class TokenNotFound(Exception):
    pass


def token_create(*, tenant: Tenant, name: str = "", expires_at: datetime | None = None) -> tuple[ApiToken, str]:
    """Create a token; returns the row and the raw token (shown once, never stored)."""
    raw, prefix, digest = ApiToken.generate()
    token = ApiToken.objects.create(tenant=tenant, name=name, prefix=prefix, token_hash=digest, expires_at=expires_at)
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
