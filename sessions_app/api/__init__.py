"""The AAP API: views, parsers, the v2 shapes at the edge, selectors, and the services the
requests call (sessions, starting and cancelling turns, validation, idempotency, admission)."""
