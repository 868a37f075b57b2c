"""The ASGI handler of the AAP API (`/v1/`): Django without a thread per request.

Django's stock ASGI handler gives every request a fresh single-thread executor (asgiref's
ThreadSensitiveContext: a thread started and joined per request) and runs every
`MiddlewareMixin` hook through it (two thread hops per middleware). Here no request
starts a thread, and a request crosses one thread hop, to its view. The API needs
neither: its middleware (`AAP_API_MIDDLEWARE`) is async-native, and its sync DRF views run
on one shared, bounded pool of threads (`AAP_WEB_THREADS`), each giving its database
connection back to the pool when the view returns. The admin keeps the stock handler and
the full `MIDDLEWARE` (sessions, CSRF, messages).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.conf import settings
from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.db import connections
from django.http import HttpRequest, HttpResponseBase
from django.middleware.clickjacking import XFrameOptionsMiddleware
from django.middleware.security import SecurityMiddleware
from django.urls import set_script_prefix


@functools.cache
def web_executor() -> ThreadPoolExecutor:
    """The web process's threads for blocking work (views, liveness checks)."""
    return ThreadPoolExecutor(max_workers=settings.AAP_WEB_THREADS, thread_name_prefix="aap-web")


def release_connections() -> None:
    """Give this thread's database connections back (to the pool, under PostgreSQL)."""
    for connection in connections.all(initialized_only=True):
        connection.close()


def on_web_threads(function):
    """`function` as a coroutine run on web_executor(), its connections released after."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        finally:
            release_connections()

    return sync_to_async(run, thread_sensitive=False, executor=web_executor())


class _AsyncChained(Protocol):
    """A middleware (Django's MiddlewareMixin) in an async chain: what follows it is async."""

    @property
    def get_response(self) -> Callable[[HttpRequest], Awaitable[HttpResponseBase]]: ...


class InlineHooksMixin:
    """For middleware whose hooks do no I/O: run them on the event loop, not via a thread."""

    async def __acall__(self: _AsyncChained, request):
        response = self.process_request(request) if hasattr(self, "process_request") else None
        response = response or await self.get_response(request)
        if hasattr(self, "process_response"):
            response = self.process_response(request, response)
        return response


class AsyncSecurityMiddleware(InlineHooksMixin, SecurityMiddleware):
    pass


class AsyncXFrameOptionsMiddleware(InlineHooksMixin, XFrameOptionsMiddleware):
    pass


class ApiHandler(ASGIHandler):
    """Django's ASGI handler with `AAP_API_MIDDLEWARE` and pooled view threads."""

    def __init__(self):
        self._pooled: dict = {}
        super().__init__()

    def load_middleware(self, is_async=False):
        # BaseHandler reads settings.MIDDLEWARE; this handler's chain is the API's.
        full = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.AAP_API_MIDDLEWARE
        try:
            super().load_middleware(is_async=is_async)
        finally:
            settings.MIDDLEWARE = full

    async def __call__(self, scope, receive, send):
        # No ThreadSensitiveContext: nothing on this path is thread-sensitive (views run on
        # web_executor(); the request signals' receivers only touch this thread's state).
        if scope["type"] != "http":
            raise ValueError(f"The API handles HTTP only, not {scope['type']}.")
        await self.handle(scope, receive, send)

    async def handle(self, scope, receive, send):
        """Django's `ASGIHandler.handle` (5.2) with the request signals sent on the event loop.
        The stock handler sends `request_started`, and `request_finished` from the response's
        close, each through a thread: two hops and two executor round trips per request. Their
        receivers are Django's own (the query log, stale connections, caches, the URLconf:
        tests/unit/test_api_handler.py keeps that list), and they touch only the calling
        thread's state, which on the loop holds no database connection (views run on
        web_executor() and release theirs)."""
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(get_script_prefix(scope))
        signals.request_started.send(sender=self.__class__, scope=scope)
        request, error_response = self.create_request(scope, body_file)
        if error_response is not None:  # create_request gives a request or an error response
            body_file.close()
            await self.send_response(error_response, send)
            error_response.close()
            return

        async def process_request(request, send):
            response = await self.run_get_response(request)
            with contextlib.suppress(asyncio.CancelledError):  # the client left while it was sent
                await self.send_response(response, send)
            return response

        # As Django does: a disconnect while the response is made cancels the view's task.
        tasks = [
            asyncio.create_task(self.listen_for_disconnect(receive)),
            asyncio.create_task(process_request(request, send)),
        ]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task.done():
                try:
                    task.result()
                except RequestAborted:
                    pass
                except AssertionError:
                    body_file.close()
                    raise
            else:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        try:
            response = tasks[1].result()
        except asyncio.CancelledError:
            signals.request_finished.send(sender=self.__class__)
        else:
            response.close()  # sends request_finished
        body_file.close()

    def make_view_atomic(self, view):
        # Called per request with the URLconf's view objects: wrap each once.
        pooled = self._pooled.get(view)
        if pooled is None:
            wrapped = super().make_view_atomic(view)
            pooled = wrapped if iscoroutinefunction(wrapped) else on_web_threads(_rendered(wrapped))
            self._pooled[view] = pooled
        return pooled


def _rendered(view):
    """Render a DRF response on the view's thread, where the encoding work belongs."""

    @functools.wraps(view)
    def run(*args, **kwargs):
        response = view(*args, **kwargs)
        render = getattr(response, "render", None)
        if callable(render):
            response = render()
        return response

    return run


class PathRouter:
    """ASGI: paths under `prefixes` (and the `exact` ones) to `app`, everything else to
    `default`. By default `/v1/`, `/v2/` and `/healthz` go to the API handler and the rest
    (admin, static) to Django's: /healthz avoids the admin chain, whose CommonMiddleware
    refuses a Host outside ALLOWED_HOSTS (the container's healthcheck calls it by address)."""

    def __init__(
        self, app, default, prefixes: tuple[str, ...] = ("/v1/", "/v2/"), exact: tuple[str, ...] = ("/healthz",)
    ):
        self.app, self.default, self.prefixes, self.exact = app, default, prefixes, exact

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        app = self.app if path.startswith(self.prefixes) or path in self.exact else self.default
        return await app(scope, receive, send)
