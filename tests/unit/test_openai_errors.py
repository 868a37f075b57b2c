"""What a model failure is called when the SDK's aiohttp client (operator endpoints) raised it.

The SDK's aiohttp transport maps every `aiohttp.ClientConnectionError` to httpx2's
`ConnectTimeout`, so a refused connection, or a server that hung up, reaches the runtime as
`APITimeoutError`. `timed_out` reads the aiohttp error underneath; the e2e test
`test_an_unreachable_provider_gives_a_connection_error` shows the sentence end to end. The
first test pins the upstream mapping: when it fails, the SDK maps connection errors itself
and the cause check in `timed_out` can go.
"""

from __future__ import annotations

import aiohttp
import httpx2
import openai
import pytest
from aiohttp.client_reqrep import ConnectionKey

from agents.runtimes.openai.client import safe_error, timed_out

REQUEST = httpx2.Request("POST", "http://model.example/v1/chat/completions")


def refused() -> aiohttp.ClientConnectorError:
    key = ConnectionKey("model.example", 80, False, True, None, None, None)
    return aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "Connection refused"))


def through_the_sdk(error: Exception) -> openai.APIConnectionError:
    """`error` as the SDK raises it: the transport's mapping, then the SDK's own wrapping."""
    from openai._vendor.httpx_aiohttp.transport import map_aiohttp_exceptions  # the pinned mapping

    try:
        try:
            with map_aiohttp_exceptions():
                raise error
        except httpx2.TimeoutException as exc:
            raise openai.APITimeoutError(request=REQUEST) from exc
        except httpx2.HTTPError as exc:
            raise openai.APIConnectionError(request=REQUEST) from exc
    except openai.APIConnectionError as raised:
        return raised
    raise AssertionError("nothing was raised")


@pytest.mark.parametrize("error", [refused(), aiohttp.ServerDisconnectedError()], ids=["refused", "hung up"])
def test_the_sdks_aiohttp_transport_still_reports_connection_errors_as_timeouts(error):
    assert isinstance(through_the_sdk(error), openai.APITimeoutError), (
        "the SDK's aiohttp transport no longer maps connection errors to ConnectTimeout: "
        "timed_out's cause check (agents/runtimes/openai/client.py) may go"
    )


@pytest.mark.parametrize(
    ("error", "before", "streaming"),
    [
        (refused(), "Could not connect to the model provider (connection error); check the base URL.", False),
        (
            aiohttp.ServerDisconnectedError(),
            "The connection to the model provider broke while it was answering; the model's answer ended "
            "before it finished.",
            True,
        ),
    ],
    ids=["refused", "hung up"],
)
def test_a_closed_connection_is_not_called_a_timeout(error, before, streaming):
    raised = through_the_sdk(error)
    assert not timed_out(raised)
    assert safe_error(raised, 30, streaming=streaming) == before


@pytest.mark.parametrize(
    ("error", "streaming", "sentence"),
    [
        (aiohttp.SocketTimeoutError(), True, "The model provider stopped sending its answer for 30 seconds (timeout)."),
        (aiohttp.ConnectionTimeoutError(), False, "The model provider did not answer within 30 seconds (timeout)."),
    ],
    ids=["read", "connect"],
)
def test_a_timeout_is_still_one(error, streaming, sentence):
    """The positive control: aiohttp's own timeouts stay timeouts (and are not retried)."""
    raised = through_the_sdk(error)
    assert timed_out(raised)
    assert safe_error(raised, 30, streaming=streaming) == sentence


def test_httpx2_timeouts_are_timeouts_too():
    """The guarded pool (application-chosen endpoints) is httpx2's: its timeouts have no aiohttp cause."""
    try:
        raise openai.APITimeoutError(request=REQUEST) from httpx2.ReadTimeout("read timed out")
    except openai.APITimeoutError as exc:
        assert timed_out(exc)
    assert not timed_out(openai.APIConnectionError(request=REQUEST))
