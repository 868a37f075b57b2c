"""The base of this project's Django middleware: sync or async as the chain around it is, so
the API's async chain makes no thread hop through it."""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction


class HybridMiddleware:
    """Keeps `get_response` and marks itself a coroutine function in an async chain;
    subclasses implement `__call__` (and `_acall` for the async chain)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request):
        """The request in a sync chain; in an async chain, return `self._acall(request)`."""
        raise NotImplementedError
