"""The demo seed of `make run` and `seed_demo`: create what is absent, keep what exists.

The demo token's plaintext is kept in a 0600 file under HOSTING_VAR_DIR (the local state
`make run` already keeps there), so every start prints the same working token instead of
minting a new one; when that file is missing or its token no longer works, a new token is
minted and the earlier demo tokens are revoked, so they never pile up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from infra.crypto import hash_token
from tenancy.models import ApiToken, Tenant
from tenancy.services import token_create

from .models import Agent
from .services import ECHO_AGENT, agents_apply

DEMO_TENANT = "demo"
DEMO_TOKEN_NAME = "seed_demo"  # noqa: S105 (the token's label, not the token)


@dataclass
class DemoSeed:
    token: str
    token_file: Path
    token_reused: bool
    revoked: int = 0
    created: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def demo_token_file() -> Path:
    return Path(settings.VAR_DIR) / "demo_token"


def _read_kept_token(path: Path, tenant: Tenant) -> str | None:
    try:
        raw = path.read_text().strip()
    except OSError:
        return None
    if raw and ApiToken.objects.active().filter(tenant=tenant, token_hash=hash_token(raw)).exists():
        return raw
    return None


def _keep_token(path: Path, raw: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(raw + "\n")
    os.replace(tmp, path)


@transaction.atomic
def demo_seed(*, assistant: bool = False, token: bool = True) -> DemoSeed:
    """Create the demo tenant and agents that do not exist yet and return a working demo
    token (`token=False`: no token is looked up or minted; `DemoSeed.token` is empty)."""
    entries = [ECHO_AGENT]
    if assistant:
        from .services import assistant_agent_entry

        entries.append(assistant_agent_entry())
    created: list[str] = []
    kept: list[str] = []
    tenant, made = Tenant.objects.get_or_create(name=DEMO_TENANT, defaults={"title": "Demo tenant"})
    (created if made else kept).append(f"tenant {DEMO_TENANT}")
    existing = set(Agent.objects.filter(name__in=[e["name"] for e in entries]).values_list("name", flat=True))
    missing = [e for e in entries if e["name"] not in existing]
    if missing:
        agents_apply(missing)
    created += [f"agent {e['name']}" for e in missing]
    kept += [f"agent {name}" for name in sorted(existing)]

    path = demo_token_file()
    if not token:
        return DemoSeed("", path, False, created=created, kept=kept)
    raw = _read_kept_token(path, tenant)
    if raw is not None:
        return DemoSeed(raw, path, True, created=created, kept=kept)
    revoked = ApiToken.objects.filter(tenant=tenant, name=DEMO_TOKEN_NAME, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )
    _, raw = token_create(tenant=tenant, name=DEMO_TOKEN_NAME)
    # Written last: should the transaction fail, the file still names a token that works.
    transaction.on_commit(lambda: _keep_token(path, raw))
    return DemoSeed(raw, path, False, revoked, created, kept)
