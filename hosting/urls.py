from django.contrib import admin
from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from sessions_app import views as aap

from .views import healthz

urlpatterns = [
    path("v1/meta", aap.MetaView.as_view(), name="aap-meta"),
    path("v1/sessions", aap.SessionsView.as_view(), name="aap-sessions"),
    path("v1/sessions/<str:session_id>", aap.SessionView.as_view(), name="aap-session"),
    path("v1/sessions/<str:session_id>/history", aap.HistoryView.as_view(), name="aap-history"),
    path("v1/sessions/<str:session_id>/turns", aap.TurnsView.as_view(), name="aap-turns"),
    path("v1/sessions/<str:session_id>/turns/<str:turn_id>/events", aap.TurnEventsView.as_view(), name="aap-turn-events"),
    path("v1/sessions/<str:session_id>/turns/<str:turn_id>/cancel", aap.TurnCancelView.as_view(), name="aap-turn-cancel"),
    path("v1/openapi.json", SpectacularAPIView.as_view(authentication_classes=[], permission_classes=[]), name="openapi"),
    path(
        "v1/docs",
        SpectacularSwaggerView.as_view(url_name="openapi", authentication_classes=[], permission_classes=[]),
        name="docs",
    ),
    path("healthz", healthz, name="healthz"),
    path("admin/", admin.site.urls),
]

handler400 = "hosting.errors.handler400"
handler403 = "hosting.errors.handler403"
handler404 = "hosting.errors.handler404"
handler500 = "hosting.errors.handler500"
