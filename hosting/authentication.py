"""`Authorization: Bearer <token>` authentication for the AAP API."""

from datetime import timedelta
from datetime import timezone as dt_timezone

from django.db import connection
from django.utils import timezone
from rest_framework import authentication, exceptions, permissions

from .models import ApiToken, Tenant, hash_token

# last_used_at is a hint for operators, so write it at most once a minute per token.
LAST_USED_RESOLUTION = timedelta(seconds=60)


class TenantUser:
    """The authenticated principal of an API request: a tenant, through one token."""

    is_authenticated = True
    is_anonymous = False

    def __init__(self, token: ApiToken):
        self.token = token
        self.tenant = token.tenant

    def __str__(self) -> str:
        return f"tenant:{self.tenant.name}"


def tenant_for_raw_token(raw: str) -> ApiToken | None:
    """The active token with this value, its tenant loaded; None if unknown, expired, revoked
    or of a disabled tenant. One SQL statement: every API request runs it."""
    now = timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT k.id, k.tenant_id, k.last_used_at, t.name, t.title FROM {ApiToken._meta.db_table} k "
            f"JOIN {Tenant._meta.db_table} t ON t.id = k.tenant_id "
            "WHERE k.token_hash = %s AND k.revoked_at IS NULL AND t.is_active "
            "AND (k.expires_at IS NULL OR k.expires_at > %s)",
            [hash_token(raw), connection.ops.adapt_datetimefield_value(now)],
        )
        row = cursor.fetchone()
    if row is None:
        return None
    token_id, tenant_id, last_used, name, title = row
    if last_used is not None and timezone.is_naive(last_used):
        last_used = timezone.make_aware(last_used, dt_timezone.utc)  # SQLite stores UTC, naive
    # Instances of the columns read; any other field loads on access (deferred).
    token = ApiToken.from_db("default", ["id", "tenant_id", "last_used_at"], [token_id, tenant_id, last_used])
    token.tenant = Tenant.from_db("default", ["id", "name", "title"], [tenant_id, name, title])
    if last_used is None or now - last_used > LAST_USED_RESOLUTION:
        ApiToken.objects.filter(pk=token_id).update(last_used_at=now)
    return token


def token_is_active(token_id: int) -> bool:
    """The token is neither revoked nor expired and its tenant is active (open streams recheck it)."""
    from django.db.models import Q

    return ApiToken.objects.filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now()),
        pk=token_id, revoked_at__isnull=True, tenant__is_active=True,
    ).exists()


class BearerTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request)
        if not header:
            return None
        parts = header.split()
        if parts[0].lower() != self.keyword.lower().encode():
            raise exceptions.AuthenticationFailed("Use 'Authorization: Bearer <api token>'.")
        if len(parts) != 2:
            raise exceptions.AuthenticationFailed(
                "The Authorization header must be 'Bearer' followed by one API token."
            )
        try:
            raw = parts[1].decode()
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed("The API token is not valid text.") from None
        token = tenant_for_raw_token(raw)
        if token is None:
            raise exceptions.AuthenticationFailed(
                "The API token is unknown, expired or revoked; ask the operator for a new one."
            )
        return TenantUser(token), token

    def authenticate_header(self, request):
        return self.keyword


class IsTenant(permissions.BasePermission):
    message = "An API token is required: send 'Authorization: Bearer <api token>'."

    def has_permission(self, request, view):
        return isinstance(request.user, TenantUser)
