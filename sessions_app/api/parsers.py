"""The parsers of the requests that carry messages: each counts the body's messages, content
parts and tools before the body is parsed (services.validation.check_body_size), so a body of
200,000 tiny messages is refused without building 200,000 dicts."""

from __future__ import annotations

from infra.errors import LimitedJSONParser

from .services.validation import check_body_size


class TurnBodyParser(LimitedJSONParser):
    """A turn's request: at most AAP_MAX_TURN_MESSAGES messages."""

    seed = False

    def check_before_parse(self, raw: bytes) -> None:
        check_body_size(raw, seed=self.seed)


class SessionBodyParser(TurnBodyParser):
    """A session's creation: its seed history holds at most AAP_MAX_SEED_MESSAGES messages."""

    seed = True
