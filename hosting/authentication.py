"""`Authorization: Bearer <token>` authentication for the AAP API."""

from datetime import timedelta

from django.utils import timezone
from rest_framework import authentication, exceptions, permissions

from .models import ApiToken, hash_token

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
    token = ApiToken.objects.active().select_related("tenant").filter(token_hash=hash_token(raw)).first()
    if token is None:
        return None
    now = timezone.now()
    if token.last_used_at is None or now - token.last_used_at > LAST_USED_RESOLUTION:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return token


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
