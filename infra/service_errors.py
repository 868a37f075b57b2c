"""Refusals the services raise on purpose, free of any web framework: one actionable sentence
and, optionally, details a client can act on. infra/errors.py turns each kind into an HTTP
answer (status code, headers, the JSON error body); nothing here knows HTTP."""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    """A refusal: `message` is one sentence saying what to do; `details` is JSON-ready."""

    def __init__(self, message: str, *, details: Any = None):
        super().__init__(message)
        self.message = message
        self.details = details


class BadRequest(ServiceError):
    """The request is wrong in a way its sender can fix."""


class NotFound(ServiceError):
    """What the request names does not exist (for this tenant)."""


class Conflict(ServiceError):
    """The request clashes with the current state (a turn is already running)."""


class IdempotencyKeyReused(ServiceError):
    """An Idempotency-Key came back with a different request."""


class PayloadTooLarge(ServiceError):
    """The request body is over the configured limit."""


class TooManyRequests(ServiceError):
    """A limit names itself in the sentence; `retry_after` says when to try again (seconds)."""

    def __init__(self, message: str, *, retry_after: float, limit: str):
        super().__init__(message, details={"limit": limit})
        self.retry_after = max(1, int(retry_after + 0.999))
