"""The /try/ chat page. It talks to the service only through the public AAP API from the
browser (the API token stays in the browser's session storage), so it needs no server state."""

from django.conf import settings
from django.http import JsonResponse
from django.shortcuts import render


def try_page(request):
    if not settings.AAP_TRY_PAGE:
        return JsonResponse(
            {"error": "The /try/ page is off; the operator can enable it with AAP_TRY_PAGE=true."}, status=404
        )
    if request.method not in ("GET", "HEAD"):
        return JsonResponse({"error": "The /try/ page only answers GET."}, status=405, headers={"Allow": "GET, HEAD"})
    response = render(request, "playground/try.html")
    # The page handles an API token: never cached, never framed, no referrer to elsewhere.
    response["Cache-Control"] = "no-store"
    response["Referrer-Policy"] = "no-referrer"
    response["Content-Security-Policy"] = (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: https:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    )
    return response
