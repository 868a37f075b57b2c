from django.contrib import admin
from django.urls import path, re_path, register_converter
from django.urls.converters import SlugConverter
from drf_spectacular.views import SpectacularJSONAPIView, SpectacularSwaggerSplitView

from infra import metrics
from infra.views import healthz
from sessions_app import usage_admin
from sessions_app.api import views as aap
from sessions_app.api.playground import views as playground
from sessions_app.api.v2 import views as aap_v2

from . import openapi  # noqa: F401  (registers the bearer scheme of the OpenAPI document)

# A session or turn id: `sess_`/`turn_` + URL-safe base64, so a NUL never reaches SQL (a 404,
# not a 500). Django's slug converter matches exactly that alphabet; registered as `id`, the
# route templates (metric labels, span names) keep saying `<id:...>`.
register_converter(SlugConverter, "id")

urlpatterns = [
    path("v1/meta", aap.MetaView.as_view(), name="aap-meta"),
    path("v1/sessions", aap.SessionsView.as_view(), name="aap-sessions"),
    path("v1/sessions/<id:session_id>", aap.SessionView.as_view(), name="aap-session"),
    path("v1/sessions/<id:session_id>/history", aap.HistoryView.as_view(), name="aap-history"),
    path("v1/sessions/<id:session_id>/turns", aap.TurnsView.as_view(), name="aap-turns"),
    path("v1/sessions/<id:session_id>/turns/<id:turn_id>", aap.TurnView.as_view(), name="aap-turn"),
    path("v1/sessions/<id:session_id>/turns/<id:turn_id>/events", aap.TurnEventsView.as_view(), name="aap-turn-events"),
    path("v1/sessions/<id:session_id>/turns/<id:turn_id>/cancel", aap.TurnCancelView.as_view(), name="aap-turn-cancel"),
    # The v2-era paths under /v1/ say where each surface lives (a v2-era client given /v1 as its base URL).
    re_path(r"^v1/session(?:/.*)?$", aap_v2.v1_session_path, name="aap-v1-session-moved"),
    # The v2-era surface (seed 001): other shapes, the same sessions and services.
    path("v2/meta", aap_v2.MetaView.as_view(), name="aap-v2-meta"),
    path("v2/session", aap_v2.SessionCreateView.as_view(), name="aap-v2-session-create"),
    path("v2/session/<id:session_id>", aap_v2.SessionView.as_view(), name="aap-v2-session"),
    path("v2/sessions", aap_v2.SessionsView.as_view(), name="aap-v2-sessions"),
    path(
        "v2/session/<id:session_id>/turns/<id:turn_id>/events",
        aap_v2.TurnEventsView.as_view(),
        name="aap-v2-turn-events",
    ),
    path(
        "v2/session/<id:session_id>/turns/<id:turn_id>/cancel",
        aap_v2.TurnCancelView.as_view(),
        name="aap-v2-turn-cancel",
    ),
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

handler400 = "infra.errors.handler400"
handler403 = "infra.errors.handler403"
handler404 = "infra.errors.handler404"
handler500 = "infra.errors.handler500"
