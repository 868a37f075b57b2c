"""Middleware of both request chains (the API's and the admin's): host validation and the
Content-Security-Policy. Both are async-native (no thread hop on the API's path)."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import DisallowedHost

from .errors import json_error
from .middleware_base import HybridMiddleware

# Answered whatever Host says: the container's healthcheck calls it by address.
HOST_EXEMPT_PATHS = ("/healthz",)


class _Middleware(HybridMiddleware):
    def __call__(self, request):
        if self.is_async:
            return self._acall(request)
        return self.before(request) or self.after(request, self.get_response(request))

    async def _acall(self, request):
        return self.before(request) or self.after(request, await self.get_response(request))

    def before(self, request):
        return None

    def after(self, request, response):
        return response


class HostValidationMiddleware(_Middleware):
    """A `Host` outside ALLOWED_HOSTS gets a JSON 400 on every path but /healthz, before any
    view (so a DNS-rebinding page cannot read /v1/meta or the docs through this server)."""

    def before(self, request):
        if request.path in HOST_EXEMPT_PATHS:
            return None
        try:
            request.get_host()
        except DisallowedHost:
            return json_error(
                "This server does not answer to the host name in the Host header; "
                "use one of the names it is configured for (ALLOWED_HOSTS).",
                400,
            )
        return None


class ContentSecurityPolicyMiddleware(_Middleware):
    """Content-Security-Policy (AAP_CONTENT_SECURITY_POLICY) on the HTML pages: admin and /v1/docs."""

    def after(self, request, response):
        policy = settings.AAP_CONTENT_SECURITY_POLICY
        if policy and response.get("Content-Type", "").startswith("text/html"):
            response.headers.setdefault("Content-Security-Policy", policy)
        return response
