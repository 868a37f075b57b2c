"""`Authorization: Bearer <token>` authentication for the AAP API."""

import time
from datetime import UTC, timedelta

from django.conf import settings
from django.core import signing
from django.db import connection
from django.utils import timezone
from rest_framework import authentication, exceptions, permissions

from infra import limits
from infra.crypto import hash_token

from .models import LIMIT_FIELDS, ApiToken, Tenant

# The tenant's limits come with its token (one statement), so admission reads no more rows.
_LIMIT_COLUMNS = ", ".join(f"t.{field}" for field in LIMIT_FIELDS)

# last_used_at is a hint for operators, so write it at most once a minute per token.
LAST_USED_RESOLUTION = timedelta(seconds=60)

# token hash -> (monotonic time read, row) of tokens found active (see tenant_for_raw_token).
_cache: dict[str, tuple[float, tuple]] = {}
AUTH_CACHE_ENTRIES = 10_000


class TenantUser:
    """The authenticated principal of an API request: a tenant, through one token.

    `turn_scope` is set when the request came with an events ticket: then it may read only
    the events of that one (session id, turn id)."""

    is_authenticated = True
    is_anonymous = False

    def __init__(self, token: ApiToken, turn_scope: tuple[str, str] | None = None):
        self.token = token
        self.tenant = token.tenant
        self.turn_scope = turn_scope

    def __str__(self) -> str:
        return f"tenant:{self.tenant.name}"


def tenant_for_raw_token(raw: str) -> ApiToken | None:
    """The active token with this value, its tenant loaded; None if unknown, expired, revoked
    or of a disabled tenant. One SQL statement, or none while the token's row is cached.

    A token found active is remembered in this process for AAP_AUTH_CACHE_SECONDS (default
    5): within that bound a revocation, a disabled tenant or changed tenant limits may not be
    seen yet by a new request (open streams recheck their token on their own schedule, and
    an expiry date is checked on every request). Unknown tokens are never cached."""
    key = hash_token(raw)
    ttl = settings.AAP_AUTH_CACHE_SECONDS
    if ttl > 0:
        cached = _cache.get(key)
        if cached is not None and time.monotonic() - cached[0] < ttl:
            kept = cached[1]
            if kept[3] is None or kept[3] > timezone.now():
                return _token_from_row(kept)
    row = _active_row("k.token_hash = %s", key)
    if row is None:
        _cache.pop(key, None)
    elif ttl > 0:
        if len(_cache) >= AUTH_CACHE_ENTRIES:
            _cache.clear()  # rare (that many distinct tokens within seconds): start over
        _cache[key] = (time.monotonic(), row)
    return None if row is None else _token_from_row(row)


def _active_token(where: str, value) -> ApiToken | None:
    row = _active_row(where, value)
    return None if row is None else _token_from_row(row)


def _active_row(where: str, value) -> tuple | None:
    now = timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(
            # `where` is one of this module's fixed conditions; the value is a parameter.
            f"SELECT k.id, k.tenant_id, k.last_used_at, k.expires_at, t.name, t.title, {_LIMIT_COLUMNS} "  # noqa: S608
            f"FROM {ApiToken._meta.db_table} k "
            f"JOIN {Tenant._meta.db_table} t ON t.id = k.tenant_id "
            f"WHERE {where} AND k.revoked_at IS NULL AND t.is_active "
            "AND (k.expires_at IS NULL OR k.expires_at > %s)",
            [value, connection.ops.adapt_datetimefield_value(now)],
        )
        row = cursor.fetchone()
    if row is None:
        return None
    token_id, tenant_id, last_used, expires_at, *rest = row
    last_used, expires_at = _aware(last_used), _aware(expires_at)
    if last_used is None or now - last_used > LAST_USED_RESOLUTION:
        ApiToken.objects.filter(pk=token_id).update(last_used_at=now)
        last_used = now
    return (token_id, tenant_id, last_used, expires_at, *rest)


def _aware(value):
    if value is not None and timezone.is_naive(value):
        return timezone.make_aware(value, UTC)  # SQLite stores UTC, naive
    return value


def _token_from_row(row: tuple) -> ApiToken:
    """Fresh instances of the columns read (each request may annotate its own); any other
    field loads on access (deferred)."""
    token_id, tenant_id, last_used, _expires_at, name, title, *limits = row
    token = ApiToken.from_db("default", ["id", "tenant_id", "last_used_at"], [token_id, tenant_id, last_used])
    token.tenant = Tenant.from_db("default", ["id", "name", "title", *LIMIT_FIELDS], [tenant_id, name, title, *limits])
    return token


def token_is_active(token_id: int) -> bool:
    """The token is neither revoked nor expired and its tenant is active (open streams recheck it)."""
    from django.db.models import Q

    return ApiToken.objects.filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now()),
        pk=token_id,
        revoked_at__isnull=True,
        tenant__is_active=True,
    ).exists()


class BearerTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request)
        if not header:
            return None
        parts = header.split()
        if not parts:
            return None
        if parts[0].lower() != self.keyword.lower().encode():
            raise exceptions.AuthenticationFailed("Use 'Authorization: Bearer <api token>'.")
        if len(parts) == 1:
            return None  # "Bearer " with nothing after it: clients send that for an empty key
        if len(parts) != 2:
            raise exceptions.AuthenticationFailed(
                "The Authorization header must be 'Bearer' followed by one API token."
            )
        try:
            raw = parts[1].decode()
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed("The API token is not valid text.") from None
        # An address that keeps sending bad tokens is refused before any database query.
        address = limits.client_address(request)
        limits.check_auth_failures(address)
        token = tenant_for_raw_token(raw)
        if token is None:
            limits.record_auth_failure(address)
            raise exceptions.AuthenticationFailed(
                "The API token is unknown, expired or revoked; ask the operator for a new one."
            )
        token.tenant._aap_rate_state = limits.turns_rate_state(token.tenant)
        return TenantUser(token), token

    def authenticate_header(self, request):
        return self.keyword


class IsTenant(permissions.BasePermission):
    message = "An API token is required: send 'Authorization: Bearer <api token>'."

    def has_permission(self, request, view):
        return isinstance(request.user, TenantUser)


# --- events tickets: how a browser's EventSource (which cannot send headers) re-attaches ----

TICKET_SALT = "aap.turn-events-ticket"


def turn_events_ticket(token: ApiToken, session_id: str, turn_id: str) -> str:
    """A signed, expiring capability to read one turn's events, bound to the token that
    started the turn (revoking the token voids its tickets). Sent as `AAP-Events-Ticket`."""
    return signing.dumps([token.pk, session_id, turn_id], salt=TICKET_SALT, compress=False)


class EventsTicketAuthentication(authentication.BaseAuthentication):
    """`?ticket=<AAP-Events-Ticket>` on the re-attach endpoint only."""

    def authenticate(self, request):
        ticket = request.query_params.get("ticket")
        if not ticket:
            return None
        try:
            token_id, session_id, turn_id = signing.loads(
                ticket, salt=TICKET_SALT, max_age=settings.AAP_EVENTS_TICKET_SECONDS
            )
        except signing.SignatureExpired:
            raise exceptions.AuthenticationFailed(
                "This events ticket has expired; re-attach with 'Authorization: Bearer <api token>'."
            ) from None
        except (signing.BadSignature, ValueError, TypeError):
            raise exceptions.AuthenticationFailed(
                "The events ticket is not valid; use the turn's AAP-Events-Ticket."
            ) from None
        token = _active_token("k.id = %s", token_id) if isinstance(token_id, int) else None
        if token is None:
            raise exceptions.AuthenticationFailed(
                "The API token this events ticket was issued to is expired or revoked."
            )
        return TenantUser(token, turn_scope=(str(session_id), str(turn_id))), token
