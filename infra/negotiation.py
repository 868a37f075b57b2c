"""Content negotiation that never stands in the way of the protocol.

AAP clients send `Accept: text/event-stream` (the TypeScript SDK on every streamed turn, a
browser's EventSource on every re-attach), yet a turn answers JSON or SSE according to its
`stream` field, and errors are JSON. DRF's default negotiation would answer 406 to such a
request before authentication and before the session lookup; this one answers in the
endpoint's own format instead (HTTP lets a server ignore an Accept it cannot satisfy), so
401 and 404 keep their meaning for every client.
"""

from rest_framework.exceptions import NotAcceptable
from rest_framework.negotiation import DefaultContentNegotiation


class ProtocolContentNegotiation(DefaultContentNegotiation):
    def select_renderer(self, request, renderers, format_suffix=None):
        try:
            return super().select_renderer(request, renderers, format_suffix)
        except NotAcceptable:
            if format_suffix or request.query_params.get(self.settings.URL_FORMAT_OVERRIDE):
                raise  # an explicit ?format= the endpoint does not have is the client's error
            return renderers[0], renderers[0].media_type
