"""ASGI entry point: Channels' protocol router in front of Django, served by Daphne.

HTTP goes to Django: `/v1/` (the AAP API) and `/v2/` (its v2-era surface) through infra.handlers.ApiHandler (async
middleware, views on a shared thread pool), the rest (admin, static, health) through the
stock handler. A turn's stream is handed off by its view to TurnStreamHandoff, which
writes it from the event loop (no thread and no database connection per open stream);
V2TurnShaper, which only `/v2/` requests pass through, reshapes the bodies of their turns
on the way out. Static files (admin) are served here too, for a self-contained deployment.
"""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hosting.settings")

from channels.routing import ProtocolTypeRouter
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.asgi import get_asgi_application

django_asgi = get_asgi_application()

from infra.handlers import ApiHandler, PathRouter  # noqa: E402
from sessions_app.api.v2.stream import V2TurnShaper  # noqa: E402
from sessions_app.engine.stream import TurnStreamHandoff  # noqa: E402  (needs Django set up)

served = TurnStreamHandoff(PathRouter(ApiHandler(), ASGIStaticFilesHandler(django_asgi)))
# Only `/v2/` responses pass through the v2 shaper.
application = ProtocolTypeRouter({"http": PathRouter(V2TurnShaper(served), served, prefixes=("/v2/",), exact=())})


def _let_django_read_bodies() -> None:
    """Twisted parses form and multipart bodies before Daphne sees a request, answering a
    malformed one with a bare HTML 400 (not the API's JSON error) and parsing the content
    type of every POST (through the `email` package); Daphne never uses what it parsed.
    Django reads every body instead (the API's JSON parser answers what it cannot read with
    a JSON 4xx)."""
    from daphne.http_protocol import WebRequest

    WebRequest._parsePOSTFormSubmission = property(lambda self: False, lambda self, value: None)


_let_django_read_bodies()

from infra import server_limits  # noqa: E402

# Body size and slow-client limits at the HTTP layer, before authentication or any view.
server_limits.install()

from infra.process import freeze_startup_heap  # noqa: E402

freeze_startup_heap()
