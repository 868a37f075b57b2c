"""The operator's usage page in the admin (`/admin/usage/`): every tenant's turns, model tokens
and turn time over a date range — the numbers tenants read from GET /v1/usage."""

from django.contrib import admin
from django.template.response import TemplateResponse

from infra.service_errors import BadRequest

from .api import selectors


def usage_view(request):
    error, rows, query = "", [], None
    try:
        query = selectors.usage_query(request.GET)
        rows = selectors.usage_by_tenant(start=query["start"], end=query["end"])
    except BadRequest as exc:
        error = exc.message
    context = {
        **admin.site.each_context(request),
        "title": "Usage by tenant",
        "rows": rows,
        "error": error,
        "start": request.GET.get("from", query["start"].date().isoformat() if query else ""),
        "end": request.GET.get("to", ""),
        "window": query,
    }
    return TemplateResponse(request, "admin/sessions_app/usage.html", context, status=400 if error else 200)


usage = admin.site.admin_view(usage_view)
