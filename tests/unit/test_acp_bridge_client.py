"""The ACP client side of the bridge (BridgeClient) is a whole acp.Client: what it does not
serve it answers as the SDK answers a client without the method. An extension request is
refused as unknown, an extension notification ignored, and elicitation, part of the unstable
protocol the bridge does not enable, is refused."""

from __future__ import annotations

import asyncio

import acp
import pytest
from acp.client.router import build_client_router

from agents.runtimes.acp_bridge.process import AgentProcess, BridgeClient, ProcessSpec


def router():
    return build_client_router(BridgeClient(AgentProcess(ProcessSpec(key="k", label="a/t/k", argv=("agent",), env={}))))


def test_an_extension_request_is_an_unknown_method():
    with pytest.raises(acp.RequestError) as refused:
        asyncio.run(router()("_vendor/thing", {"x": 1}, False))
    assert refused.value.code == -32601


def test_an_extension_notification_is_ignored():
    assert asyncio.run(router()("_vendor/event", {"x": 1}, True)) is None


@pytest.mark.filterwarnings("ignore:The method elicitation:UserWarning")
def test_elicitation_is_an_unknown_method():
    params = {"sessionId": "s", "mode": "form", "message": "Your name?", "requestedSchema": {"type": "object"}}
    with pytest.raises(acp.RequestError) as refused:
        asyncio.run(router()("elicitation/create", params, False))
    assert refused.value.code == -32601
