"""ASGI entry point: Channels' protocol router in front of Django, served by Daphne.

HTTP goes to Django; turn streams are async responses on the event loop (no thread per
open stream). Static files (admin) are served here too, for a self-contained deployment.
"""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hosting.settings")

from channels.routing import ProtocolTypeRouter  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi = get_asgi_application()

application = ProtocolTypeRouter({"http": ASGIStaticFilesHandler(django_asgi)})
