"""Tenancy: tenants and their API tokens."""

import secrets
from typing import TYPE_CHECKING

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone

from infra.crypto import hash_token

if TYPE_CHECKING:
    from infra.limits import RateState

TOKEN_PREFIX = "aap_"  # noqa: S105 (the public prefix of every token, not a token)


class Tenant(models.Model):
    """An application (customer) of the service; owns its sessions and tokens."""

    name = models.SlugField(max_length=100, unique=True)
    title = models.CharField(max_length=200, blank=True)
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Limits (sessions_app.api.admission): empty means the settings' default, 0 means no limit.
    max_running_turns = models.PositiveIntegerField(
        null=True, blank=True, help_text="Turns running at once (empty: AAP_TENANT_MAX_RUNNING_TURNS; 0: no limit)."
    )
    max_queued_turns = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Turns waiting for a worker beyond the running ones (empty: AAP_TENANT_MAX_QUEUED_TURNS).",
    )
    turns_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="Turns started per minute (empty: AAP_TENANT_TURNS_PER_MINUTE; 0: no limit)."
    )
    max_sessions = models.PositiveIntegerField(
        null=True, blank=True, help_text="Sessions kept at once (empty: AAP_TENANT_MAX_SESSIONS; 0: no limit)."
    )
    tokens_per_day = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        help_text="LLM tokens (prompt + completion) per UTC day (empty: AAP_TENANT_TOKENS_PER_DAY; 0: no limit).",
    )
    # Fair scheduling (sessions_app.engine.queue): free worker slots go to the tenant with the
    # fewest running turns per unit of weight.
    weight = models.PositiveSmallIntegerField(
        default=1,
        db_default=1,
        validators=[MinValueValidator(1), MaxValueValidator(1000)],
        help_text="Share of the workers when they are all busy: a tenant of weight 2 runs twice as many turns "
        "at once as a tenant of weight 1 that waits too (1-1000).",
    )
    # Not a column: the turns-per-minute window of the request's tenant, left on it by the API's
    # authentication and by a turn start for the rate headers (infra.limits).
    _aap_rate_state: "RateState | None"

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


LIMIT_FIELDS = ("max_running_turns", "max_queued_turns", "turns_per_minute", "max_sessions", "tokens_per_day")


class ApiTokenQuerySet(models.QuerySet):
    def active(self):
        now = timezone.now()
        return self.filter(revoked_at__isnull=True, tenant__is_active=True).filter(
            models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=now)
        )


class ApiToken(models.Model):
    """A bearer token of one tenant. Only its hash is stored; the token is shown once."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="tokens")
    name = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = ApiTokenQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.tenant})"

    @property
    def is_active(self) -> bool:
        if self.revoked_at is not None:
            return False
        return self.expires_at is None or self.expires_at > timezone.now()

    @classmethod
    def generate(cls) -> tuple[str, str, str]:
        """A new raw token, its visible prefix and its hash."""
        prefix = TOKEN_PREFIX + secrets.token_hex(4)
        raw = f"{prefix}_{secrets.token_urlsafe(32)}"
        return raw, prefix, hash_token(raw)
