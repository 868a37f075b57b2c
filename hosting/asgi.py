"""ASGI entry point: Channels' protocol router in front of Django, served by Daphne.

HTTP goes to Django: `/v1/` (the AAP API) through hosting.handlers.ApiHandler (async
middleware, views on a shared thread pool), the rest (admin, static, health) through the
stock handler. A turn's stream is handed off by its view to TurnStreamHandoff, which
writes it from the event loop (no thread and no database connection per open stream). Static files (admin) are served here too, for a self-contained deployment.
"""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hosting.settings")

from channels.routing import ProtocolTypeRouter  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi = get_asgi_application()

from hosting.handlers import ApiHandler, PathRouter  # noqa: E402

from sessions_app.streaming import TurnStreamHandoff  # noqa: E402  (needs Django set up)

application = ProtocolTypeRouter(
    {"http": TurnStreamHandoff(ASGIStaticFilesHandler(PathRouter(ApiHandler(), django_asgi)))}
)

from hosting.process import freeze_startup_heap  # noqa: E402

freeze_startup_heap()
