"""The framework code the server layer wraps or replaces, pinned: an upgrade of Daphne,
Twisted or Django that changes any of it fails here, naming the patch to re-read.

Each pin is the installed release and a digest of the upstream method's source as that
release ships it. When one fails: read the new upstream method, check that the patch still
does what its docstring says (and is still needed: docs/performance.md says how to profile
the ones that save CPU), then update the pin."""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path

import pytest

RELEASES = {"daphne": "4.2.3", "twisted": "26.10.0", "django": "5.2.19"}

# (module, Class.method) -> (digest of its source, the project's code that depends on it)
PINS = {
    ("daphne.http_protocol", "WebRequest.handle_reply"): ("101a7bbf4292dc40", "infra/server_limits.py: flow control"),
    ("daphne.server", "Server.handle_reply"): ("2d3dceaa037c2c83", "infra/server_limits.py: flow control"),
    ("daphne.http_protocol", "WebRequest.basic_error"): ("75c40bc366e84add", "infra/server_limits.py: JSON refusals"),
    ("twisted.web.http", "Request.handleContentChunk"): ("7231aa98dddfd6b0", "infra/server_limits.py: body limit"),
    ("twisted.web.http", "Request.requestReceived"): ("ef516c4a44258acb", "hosting/asgi.py: Django reads bodies"),
    ("twisted.web.http", "HTTPChannel.dataReceived"): ("cff2ad77a90d8575", "infra/server_limits.py: deadlines"),
    ("twisted.web.http", "HTTPChannel.allHeadersReceived"): ("0a8dfaba39cbefb1", "infra/server_limits.py"),
    ("twisted.web.http", "HTTPChannel.allContentReceived"): ("dd65e80af12385fe", "infra/server_limits.py"),
    ("twisted.web.http", "HTTPChannel.connectionLost"): ("b3c612ec737956c0", "infra/server_limits.py"),
    ("twisted.web.http", "HTTPChannel._respondToBadRequestAndDisconnect"): (
        "4eb156b7faff5921",
        "infra/server_limits.py",
    ),
    ("twisted.protocols.basic", "LineReceiver.lineLengthExceeded"): ("808300070114d9ab", "infra/server_limits.py"),
    ("django.core.handlers.asgi", "ASGIHandler.handle"): ("2e2dae70240a12a6", "infra/handlers.py: ApiHandler.handle"),
    ("django.core.handlers.asgi", "ASGIHandler.__call__"): ("f252eb4e47b97588", "infra/handlers.py: ApiHandler"),
}


def _digest(module: str, qualname: str) -> str | None:
    path = Path(importlib.util.find_spec(module).origin)
    text = path.read_text()
    class_name, _, name = qualname.partition(".")
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                    return hashlib.sha256(ast.get_source_segment(text, item).encode()).hexdigest()[:16]
    return None


@pytest.mark.parametrize("distribution", sorted(RELEASES))
def test_the_pinned_release_is_installed(distribution):
    installed = importlib.metadata.version(distribution)
    assert installed == RELEASES[distribution], (
        f"{distribution} {installed} is installed, the patches were checked against {RELEASES[distribution]}: "
        "re-read every pin of it below, then update RELEASES"
    )


@pytest.mark.parametrize(("module", "qualname"), sorted(PINS))
def test_the_patched_upstream_code_is_unchanged(module, qualname):
    digest, user = PINS[(module, qualname)]
    assert _digest(module, qualname) == digest, f"{module}.{qualname} changed upstream; re-check {user}"
