"""Every non-2xx answer is JSON: {"error": "<one sentence>", "details"?: ...}; and no answer is
a 406 (ProtocolContentNegotiation)."""

import logging
import re

from django import db
from django.conf import settings
from django.core.exceptions import PermissionDenied, RequestDataTooBig
from django.http import Http404, JsonResponse
from rest_framework import exceptions, status
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.parsers import JSONParser
from rest_framework.response import Response

from .middleware_base import HybridMiddleware
from .service_errors import (
    BadRequest,
    Conflict,
    IdempotencyKeyReused,
    NotFound,
    PayloadTooLarge,
    ServiceError,
    TooManyRequests,
)

logger = logging.getLogger(__name__)


# The HTTP status of each kind of service refusal (infra/service_errors.py).
SERVICE_ERROR_STATUS: dict[type[ServiceError], int] = {
    BadRequest: 400,
    NotFound: 404,
    Conflict: 409,
    PayloadTooLarge: 413,
    IdempotencyKeyReused: 422,
    TooManyRequests: 429,
}


def service_error_status(exc: ServiceError) -> int:
    return next((SERVICE_ERROR_STATUS[kind] for kind in type(exc).__mro__ if kind in SERVICE_ERROR_STATUS), 400)


def service_error_headers(exc: ServiceError) -> dict[str, str] | None:
    if isinstance(exc, TooManyRequests):
        return {"Retry-After": str(exc.retry_after)}
    return None


def body_too_large() -> PayloadTooLarge:
    return PayloadTooLarge(f"The request body is larger than the limit of {settings.AAP_MAX_BODY_BYTES} bytes.")


def _first_error(detail, path: str = "") -> tuple[str, str]:
    if isinstance(detail, dict):
        for key, value in detail.items():
            sub = key if key == "non_field_errors" else (f"{path}.{key}" if path else str(key))
            if key == "non_field_errors":
                sub = path
            return _first_error(value, sub)
    if isinstance(detail, list):
        for index, value in enumerate(detail):
            if isinstance(value, (dict, list)) and value:
                return _first_error(value, f"{path}[{index}]")
            if not isinstance(value, (dict, list)):
                return path, str(value)
    return path, str(detail)


def validation_sentence(detail) -> str:
    path, message = _first_error(detail)
    message = message.rstrip(".") + "."
    return f"Invalid request: {path}: {message}" if path else f"Invalid request: {message}"


def error_body(message: str, details=None) -> dict:
    body = {"error": message}
    if details not in (None, {}, []):
        body["details"] = details
    return body


def _is_redis_unavailable(exc) -> bool:
    """Redis cannot take a write now: unreachable, full (`maxmemory` with `noeviction`
    refuses writes with OOM) or a read-only replica during a failover."""
    try:
        from redis.exceptions import ConnectionError, OutOfMemoryError, ReadOnlyError, TimeoutError
    except ImportError:  # the embedded mode runs without redis-py
        return False
    return isinstance(exc, (ConnectionError, TimeoutError, OutOfMemoryError, ReadOnlyError))


def _view_name(context: dict) -> str:
    return type(context.get("view")).__name__


def _request_ids(context: dict) -> dict[str, str]:
    """The tenant, session and turn a failed API request was about, for its log line."""
    kwargs = context.get("kwargs") or {}
    # The user DRF set on the underlying request once authentication succeeded: reading
    # `request.user` would authenticate again (a query) when authentication is what failed.
    user = getattr(getattr(context.get("request"), "_request", None), "user", None)
    tenant = getattr(getattr(user, "tenant", None), "name", None)
    ids = {"tenant": tenant, "session": kwargs.get("session_id"), "turn": kwargs.get("turn_id")}
    return {key: str(value) for key, value in ids.items() if value}


def exception_handler(exc, context):
    """DRF exception handler producing the AAP error shape."""
    headers = {}
    if isinstance(exc, Http404):
        exc = exceptions.NotFound("Not found.")
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    elif isinstance(exc, RequestDataTooBig):
        exc = body_too_large()

    if isinstance(exc, ServiceError):
        return Response(
            error_body(exc.message, exc.details), status=service_error_status(exc), headers=service_error_headers(exc)
        )
    if isinstance(exc, exceptions.ValidationError):
        return Response(error_body(validation_sentence(exc.detail), exc.detail), status=400)
    if isinstance(exc, exceptions.ParseError):
        return Response(error_body(f"The request body is not valid JSON ({exc.detail})."), status=400)
    if isinstance(exc, exceptions.UnsupportedMediaType):
        return Response(
            error_body("Send the request body as JSON with 'Content-Type: application/json'."),
            status=415,
        )
    if isinstance(exc, exceptions.MethodNotAllowed):
        view = context.get("view")
        allowed = ", ".join(m for m in getattr(view, "allowed_methods", []) if m not in {"OPTIONS", "HEAD"})
        method = context["request"].method if context.get("request") else "This method"
        return Response(
            error_body(f"{method} is not allowed on this path; use {allowed}."),
            status=405,
            headers={"Allow": ", ".join(getattr(view, "allowed_methods", []))},
        )
    if isinstance(exc, (exceptions.NotAuthenticated, exceptions.AuthenticationFailed)):
        headers["WWW-Authenticate"] = 'Bearer realm="aap"'
        message = str(exc.detail)
        if isinstance(exc, exceptions.NotAuthenticated):
            message = "An API token is required: send 'Authorization: Bearer <api token>'."
        return Response(error_body(message), status=401, headers=headers)
    if isinstance(exc, exceptions.PermissionDenied):
        # A missing tenant identity is an authentication problem for this API.
        return Response(
            error_body("An API token is required: send 'Authorization: Bearer <api token>'."),
            status=401,
            headers={"WWW-Authenticate": 'Bearer realm="aap"'},
        )
    if isinstance(exc, exceptions.NotFound):
        return Response(error_body(str(exc.detail)), status=404)
    if isinstance(exc, exceptions.Throttled):
        wait = getattr(exc, "wait", None)  # set by Throttled() (DRF's stubs do not declare it)
        return Response(error_body(f"Too many requests; retry in {wait} seconds."), status=429)
    if isinstance(exc, exceptions.APIException):
        return Response(error_body(str(exc.detail)), status=exc.status_code)

    if isinstance(exc, (db.OperationalError, db.InterfaceError)):
        logger.error("database unavailable in %s", _view_name(context), exc_info=exc, extra=_request_ids(context))
        return Response(
            error_body("The database is unavailable or saturated right now; retry in a few seconds."),
            status=status.HTTP_503_SERVICE_UNAVAILABLE,
            headers={"Retry-After": "5"},
        )
    if _is_redis_unavailable(exc):
        logger.error("redis unavailable in %s", _view_name(context), exc_info=exc, extra=_request_ids(context))
        return Response(
            error_body("The event service is unavailable right now and nothing was stored; retry in a few seconds."),
            status=status.HTTP_503_SERVICE_UNAVAILABLE,
            headers={"Retry-After": "5"},
        )
    # The request's boundary: the traceback (frames, no message: infra/logs.py) and its ids.
    logger.error("unhandled error in %s", _view_name(context), exc_info=exc, extra=_request_ids(context))
    return Response(
        error_body("The server failed to handle this request; it was logged. Try again."),
        status=status.HTTP_500_INTERNAL_SERVER_ERROR,
    )


# A \uD800-\uDFFF escape, or the UTF-8 bytes of a surrogate (ED A0-BF ..): two patterns, each
# with a literal first byte the regex engine scans for quickly (one alternation of both reads a
# body six times slower).
MAYBE_SURROGATE = (re.compile(rb"\\u[dD][89a-fA-F]"), re.compile(rb"\xed[\xa0-\xbf]"))


class LimitedJSONParser(JSONParser):
    """JSON parser that enforces AAP_MAX_BODY_BYTES on every body, chunked or not."""

    def check_before_parse(self, raw: bytes) -> None:
        """A subclass's look at a UTF-8 body before it is parsed (raise to refuse it)."""

    def parse(self, stream, media_type=None, parser_context=None):
        limit = settings.AAP_MAX_BODY_BYTES
        if stream is None:
            raise exceptions.ParseError("the body is empty")
        raw = stream.read(limit + 1)
        if len(raw) > limit:
            raise body_too_large()
        if not raw.strip():
            raise exceptions.ParseError("the body is empty")
        import codecs
        import io
        import json

        # The charset JSONParser decodes with; a body in another one is only parsed.
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            utf8 = codecs.lookup(encoding).name == "utf-8"
        except LookupError:
            utf8 = False
        if utf8:
            self.check_before_parse(raw)

        try:
            data = super().parse(io.BytesIO(raw), media_type, parser_context)
            # A lone \ud800-style escape decodes but cannot be stored or sent back as UTF-8.
            # Surrogates come only from such escapes (or surrogate bytes, which JSON's decoder
            # lets through): without either, encoding the whole body again is skipped.
            if any(pattern.search(raw) for pattern in MAYBE_SURROGATE):
                json.dumps(data, ensure_ascii=False).encode()
        except RecursionError:
            raise exceptions.ParseError("it nests arrays or objects too deeply") from None
        except UnicodeEncodeError:
            raise exceptions.ParseError(
                "it escapes a lone UTF-16 surrogate such as \\ud800, which is not Unicode"
            ) from None
        return data


class BodyLimitMiddleware(HybridMiddleware):
    """Refuse a declared Content-Length over the limit before anything reads the body."""

    def _too_large(self, request):
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return json_error("The Content-Length header is not a number.", 400)
        if length > settings.AAP_MAX_BODY_BYTES:
            return json_error(body_too_large().message, 413)
        if not length and "chunked" in request.META.get("HTTP_TRANSFER_ENCODING", "").lower():
            # Django and DRF read no body without a Content-Length: measure the chunked one and declare it.
            body = request.read(settings.AAP_MAX_BODY_BYTES + 1)
            if len(body) > settings.AAP_MAX_BODY_BYTES:
                return json_error(body_too_large().message, 413)
            request._body = body
            request.META["CONTENT_LENGTH"] = str(len(body))
        return None

    def __call__(self, request):
        if self.is_async:
            return self._acall(request)
        return self._too_large(request) or self.get_response(request)

    async def _acall(self, request):
        return self._too_large(request) or await self.get_response(request)


def json_error(message: str, status_code: int, **headers) -> JsonResponse:
    response = JsonResponse(error_body(message), status=status_code)
    for key, value in headers.items():
        response[key] = value
    return response


def handler404(request, exception=None):
    return json_error(
        f"There is nothing at {request.path}; the AAP API lives under /v1/ (AAP v3) and /v2/ (its v2-era surface).", 404
    )


def handler500(request):
    return json_error("The server failed to handle this request; it was logged. Try again.", 500)


def handler400(request, exception=None):
    return json_error("The request could not be understood.", 400)


def handler403(request, exception=None):
    return json_error("This request is not allowed.", 403)


class ProtocolContentNegotiation(DefaultContentNegotiation):
    """Content negotiation that never stands in the way of the protocol.

    AAP clients send `Accept: text/event-stream` (the TypeScript SDK on every streamed turn, a
    browser's EventSource on every re-attach), yet a turn answers JSON or SSE according to its
    `stream` field, and errors are JSON. DRF's default negotiation would answer 406 to such a
    request before authentication and before the session lookup; this one answers in the
    endpoint's own format instead (HTTP lets a server ignore an Accept it cannot satisfy), so
    401 and 404 keep their meaning for every client."""

    def select_renderer(self, request, renderers, format_suffix=None):
        try:
            return super().select_renderer(request, renderers, format_suffix)
        except exceptions.NotAcceptable:
            if format_suffix or request.query_params.get(self.settings.URL_FORMAT_OVERRIDE):
                raise  # an explicit ?format= the endpoint does not have is the client's error
            return renderers[0], renderers[0].media_type
