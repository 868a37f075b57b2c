from django.contrib import admin
from django.urls import path, register_converter
from drf_spectacular.views import SpectacularJSONAPIView, SpectacularSwaggerSplitView

from sessions_app import usage_admin
from sessions_app import views as aap
from sessions_app.playground import views as playground

from . import metrics
from .views import healthz


class IdConverter:
    """A session or turn id: `sess_`/`turn_` + URL-safe base64, so a NUL never reaches SQL (a 404, not a 500)."""

    regex = "[A-Za-z0-9_-]+"

    def to_python(self, value):
        return value

    def to_url(self, value):
        return value


register_converter(IdConverter, "id")

urlpatterns = [
    path("v1/meta", aap.MetaView.as_view(), name="aap-meta"),
    path("v1/sessions", aap.SessionsView.as_view(), name="aap-sessions"),
    path("v1/sessions/<id:session_id>", aap.SessionView.as_view(), name="aap-session"),
    path("v1/sessions/<id:session_id>/history", aap.HistoryView.as_view(), name="aap-history"),
    path("v1/sessions/<id:session_id>/turns", aap.TurnsView.as_view(), name="aap-turns"),
    path("v1/sessions/<id:session_id>/turns/<id:turn_id>/events", aap.TurnEventsView.as_view(), name="aap-turn-events"),
    path("v1/sessions/<id:session_id>/turns/<id:turn_id>/cancel", aap.TurnCancelView.as_view(), name="aap-turn-cancel"),
    # The JSON view: the plain one answers YAML unless the client asks for JSON.
    path(
        "v1/openapi.json",
        SpectacularJSONAPIView.as_view(authentication_classes=[], permission_classes=[]),
        name="openapi",
    ),
    path(
        "v1/docs",
        # The split view serves its start-up script as a file: the page needs no inline script (CSP).
        SpectacularSwaggerSplitView.as_view(url_name="openapi", authentication_classes=[], permission_classes=[]),
        name="docs",
    ),
    path("healthz", healthz, name="healthz"),
    path("v1/usage", aap.UsageView.as_view(), name="aap-usage"),
    path("metrics", metrics.metrics_view, name="metrics"),
    path("try/", playground.try_page, name="try"),
    path("admin/usage/", usage_admin.usage, name="admin-usage"),
    path("admin/", admin.site.urls),
]

handler400 = "hosting.errors.handler400"
handler403 = "hosting.errors.handler403"
handler404 = "hosting.errors.handler404"
handler500 = "hosting.errors.handler500"
