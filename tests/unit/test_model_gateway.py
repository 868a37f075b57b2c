"""The model gateway of an ACP agent, in process: its egress proxy in front of the fake
OpenAI server (tests/fakes/openai_server.py), a real HTTP client as the agent, and the usage
it meters attributed to the running prompt."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
from types import SimpleNamespace

import httpx
import pytest

from agents.runtimes.acp_bridge.egress import EgressProxy
from agents.runtimes.acp_bridge.gateway import PREFIX, GatewaySpec, ModelGateway
from agents.runtimes.acp_bridge.process import AgentProcess, ProcessSpec
from agents.runtimes.acp_bridge.runtime import AcpRuntime
from agents.runtimes.acp_bridge.session import Prompt
from infra.logs import json_formatter
from tests.fakes.openai_server import FakeOpenAI

REAL_KEY = "sk-operator-real-key-0001"
TOKEN = "unit-token-0001"


@pytest.fixture(scope="module")
def model_server():
    with FakeOpenAI() as fake:
        yield fake


@pytest.fixture
def model(model_server):
    model_server.clear()
    return model_server


def gateway_spec(base_url: str, key: str = REAL_KEY) -> GatewaySpec:
    return GatewaySpec(base_url=base_url, url_env="MODEL_URL", token_env="MODEL_KEY", key=key, token=TOKEN)


def run_with_gateway(base_url: str, scenario, *, key: str = REAL_KEY):
    """Run `scenario(proxy_url, usage)` against a started proxy with a gateway; `usage` lists
    what the gateway counted."""
    usage: list[tuple[int, int]] = []

    async def main():
        gateway = ModelGateway(gateway_spec(base_url, key), "agent/tenant/unit", lambda p, c: usage.append((p, c)))
        proxy = EgressProxy((), "agent/tenant/unit", gateway=gateway)
        await proxy.start()
        try:
            return await scenario(proxy.url, usage)
        finally:
            await proxy.close()

    return asyncio.run(main()), usage


def chat(stream: bool = False, **extra) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": stream, **extra}


def agent_client(**kwargs) -> httpx.AsyncClient:
    return httpx.AsyncClient(trust_env=False, timeout=10, **kwargs)


# --- the key stays in the worker -----------------------------------------------------------


@pytest.mark.parametrize("through_proxy", [False, True], ids=["origin-form", "absolute-form"])
def test_the_real_key_reaches_the_model_and_the_agent_only_holds_its_token(model, through_proxy):
    model.enqueue(FakeOpenAI.text("hello", usage=(12, 3)))

    async def scenario(url, usage):
        # An agent honouring HTTP_PROXY sends the gateway's URL to the proxy in absolute form.
        async with agent_client(proxy=url if through_proxy else None) as client:
            response = await client.post(
                f"{url}{PREFIX}/chat/completions", json=chat(), headers={"Authorization": f"Bearer {TOKEN}"}
            )
            return response.status_code, response.json()

    (status, body), usage = run_with_gateway(model.url, scenario)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == "hello"
    [request] = model.chat_requests()
    assert request["headers"]["authorization"] == f"Bearer {REAL_KEY}"
    assert TOKEN not in json.dumps(request)
    assert usage == [(12, 3)]


def test_the_models_list_goes_through_and_nothing_else_does(model):
    async def scenario(url, usage):
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with agent_client() as client:
            models = await client.get(f"{url}{PREFIX}/models", headers=auth)
            others = [
                await client.post(f"{url}{PREFIX}/embeddings", json={}, headers=auth),
                await client.post(f"{url}{PREFIX}/models", json={}, headers=auth),
                await client.get(f"{url}{PREFIX}/models/../files", headers=auth),
                await client.get(f"{url}/other", headers=auth),
            ]
        return models, others

    (models, others), _ = run_with_gateway(model.url, scenario)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake-model"
    assert [r.status_code for r in others] == [404, 405, 404, 404]
    assert all("error" in r.json() for r in others)
    assert [r["path"] for r in model.requests] == ["/v1/models"]


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-token", f"Basic {TOKEN}", f"Bearer {REAL_KEY}"])
def test_a_wrong_or_missing_token_gets_401_and_nothing_reaches_the_model(model, caplog, authorization):
    async def scenario(url, usage):
        headers = {"Authorization": authorization} if authorization else {}
        async with agent_client() as client:
            return await client.post(f"{url}{PREFIX}/chat/completions", json=chat(), headers=headers)

    with caplog.at_level(logging.WARNING, logger="agents.runtimes.acp"):
        response, usage = run_with_gateway(model.url, scenario)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert model.requests == [] and usage == []
    [line] = [r.getMessage() for r in caplog.records if "model gateway" in r.getMessage()]
    assert "agent/tenant/unit" in line and "401" in line
    assert TOKEN not in caplog.text and REAL_KEY not in caplog.text
    assert not any(r.exc_info for r in caplog.records)


# --- usage ---------------------------------------------------------------------------------


def test_a_streamed_request_gets_include_usage_and_the_usage_counts_before_the_stream_ends(model):
    model.enqueue(FakeOpenAI.text("one two three", usage=(20, 5)))

    async def scenario(url, usage):
        seen = []
        async with (
            agent_client() as client,
            client.stream(
                "POST", f"{url}{PREFIX}/chat/completions", json=chat(True), headers={"Authorization": f"Bearer {TOKEN}"}
            ) as response,
        ):
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    seen.append(("done", list(usage)))
                elif line.startswith("data: "):
                    seen.append(("chunk", json.loads(line[6:])))
        return response.status_code, seen

    (status, seen), usage = run_with_gateway(model.url, scenario)
    assert status == 200
    [request] = model.chat_requests()
    assert request["json"]["stream_options"] == {"include_usage": True}
    chunks = [data for kind, data in seen if kind == "chunk"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "one two three"
    # The usage-only chunk the agent did not ask for is not passed on; it counted before [DONE].
    assert all(c["choices"] for c in chunks)
    assert seen[-1] == ("done", [(20, 5)])
    assert usage == [(20, 5)]


def test_a_stream_that_asked_for_usage_keeps_its_usage_chunk(model):
    model.enqueue(FakeOpenAI.text("ok", usage=(9, 1)))

    async def scenario(url, usage):
        async with agent_client() as client:
            response = await client.post(
                f"{url}{PREFIX}/chat/completions",
                json=chat(True, stream_options={"include_usage": True}),
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
        return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]

    chunks, usage = run_with_gateway(model.url, scenario)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 9
    assert usage == [(9, 1)]


def test_an_error_of_the_model_passes_through_uncounted(model, caplog):
    model.enqueue(FakeOpenAI.error(429, "Slow down."))

    async def scenario(url, usage):
        async with agent_client() as client:
            return await client.post(
                f"{url}{PREFIX}/chat/completions?api-version=secret-query",
                json=chat(),
                headers={"Authorization": f"Bearer {TOKEN}"},
            )

    with caplog.at_level(logging.WARNING, logger="agents.runtimes.acp"):
        response, usage = run_with_gateway(model.url, scenario)
    assert response.status_code == 429 and response.json()["error"]["message"] == "Slow down."
    assert usage == []
    assert model.chat_requests()[0]["path"] == "/v1/chat/completions"
    assert f"{model.url}/chat/completions answered 429" in caplog.text
    assert "secret-query" not in caplog.text


def test_the_key_s_account_stays_in_the_worker(model):
    """The agent cannot pick the key's organization or project, and a refusal of the key (whose
    message may quote part of it) reaches the agent as the gateway's own error."""
    model.enqueue(FakeOpenAI.text("ok"), FakeOpenAI.error(401, "Incorrect API key provided: sk-ope***0001."))

    async def scenario(url, usage):
        headers = {"Authorization": f"Bearer {TOKEN}", "OpenAI-Organization": "org-other", "Cookie": "a=b"}
        async with agent_client() as client:
            return [await client.post(f"{url}{PREFIX}/chat/completions", json=chat(), headers=headers) for _ in "12"]

    (ok, refused), _ = run_with_gateway(model.url, scenario)
    assert ok.status_code == 200
    assert not {"openai-organization", "cookie"} & set(model.chat_requests()[0]["headers"])
    assert refused.status_code == 502 and "sk-ope" not in refused.text
    assert refused.json()["error"]["message"] == "The model endpoint refused the gateway's key."


def test_an_unreachable_model_gets_a_json_502_and_a_sentence_without_key_or_query(caplog):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def scenario(url, usage):
        async with agent_client() as client:
            return await client.post(
                f"{url}{PREFIX}/chat/completions?sig=abc", json=chat(), headers={"Authorization": f"Bearer {TOKEN}"}
            )

    with caplog.at_level(logging.WARNING, logger="agents.runtimes.acp"):
        response, _ = run_with_gateway(f"http://127.0.0.1:{port}/v1", scenario)
    assert response.status_code == 502 and "error" in response.json()
    [record] = [r for r in caplog.records if "model gateway" in r.getMessage()]
    assert record.getMessage() == (
        f"model gateway: agent agent/tenant/unit: POST http://127.0.0.1:{port}/v1/chat/completions failed"
    )
    # The failure's traceback, as the service's log renders it: frames and type, no message.
    assert record.exc_info is not None and isinstance(record.exc_info[1], httpx.ConnectError)
    rendered = json_formatter().format(record)
    assert "httpx.ConnectError (message withheld)" in rendered and ", in _forward" in rendered
    assert "sig=abc" not in rendered
    assert REAL_KEY not in caplog.text and TOKEN not in caplog.text


# --- the agent's environment and the turn's usage ---------------------------------------------


def turn_context(options: dict, **extra) -> SimpleNamespace:
    return SimpleNamespace(
        tenant="demo",
        agent_name="agent",
        session_id="s_unit",
        options=options,
        prompt_tokens=0,
        completion_tokens=0,
        calls=0,
        **extra,
    )


GATEWAY_CONFIG = {
    "command": ["/bin/true"],
    "unsafeWithoutSandbox": True,
    "options": {"model": {"env": "MODEL_NAME"}},
    "gateway": {"baseUrl": "https://models.example/v1", "keyOption": "apiKey", "env": {"baseUrl": "U", "apiKey": "K"}},
}


def test_the_agent_environment_gets_the_gateway_url_and_a_token_never_the_key(tmp_path):
    from agents.runtimes.acp_bridge.config import Config

    AcpRuntime.validate_config(GATEWAY_CONFIG)
    ctx = turn_context({"apiKey": REAL_KEY, "model": "m1"}, config=GATEWAY_CONFIG)
    spec = AcpRuntime._build_spec(AcpRuntime.__new__(AcpRuntime), ctx, Config.parse(GATEWAY_CONFIG))
    spec = dataclasses.replace(spec, home=tmp_path)
    assert REAL_KEY not in json.dumps(spec.env) and spec.gateway.key == REAL_KEY
    assert spec.redact(f"key {REAL_KEY} token {spec.gateway.token}") == "key *** token ***"

    async def command():
        process = AgentProcess(spec)
        try:
            argv, env, *_ = await process._command()
            return argv, env, process.proxy.url
        finally:
            await process._close_proxy()

    argv, env, proxy_url = asyncio.run(command())
    assert REAL_KEY not in json.dumps([argv, env])
    assert env["U"] == proxy_url + PREFIX and env["K"] == spec.gateway.token and env["MODEL_NAME"] == "m1"
    other = AcpRuntime._build_spec(AcpRuntime.__new__(AcpRuntime), ctx, Config.parse(GATEWAY_CONFIG))
    assert other.gateway.token != spec.gateway.token  # random per unit
    tenant_key = AcpRuntime._build_spec(
        AcpRuntime.__new__(AcpRuntime),
        turn_context({"apiKey": "sk-tenant-own", "model": "m1"}, config=GATEWAY_CONFIG),
        Config.parse(GATEWAY_CONFIG),
    )
    assert tenant_key.key != spec.key  # another key never shares the unit


class Ctx:
    def __init__(self):
        self.usage: list[tuple[int, int]] = []

    def add_usage(self, *, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        self.usage.append((prompt_tokens, completion_tokens))


def test_usage_goes_to_the_running_prompt_the_oldest_when_several_run(caplog):
    process = AgentProcess(ProcessSpec(key="k", label="agent/tenant/k", argv=("x",), env={}))
    with caplog.at_level(logging.INFO, logger="agents.runtimes.acp"):
        process.add_usage(5, 5)  # no prompt runs: not counted, said so
    assert "outside any prompt; not counted" in caplog.text
    older, newer = Prompt(started_at=1.0), Prompt(started_at=2.0)
    process.sessions = {"a": SimpleNamespace(prompt=newer), "b": SimpleNamespace(prompt=older)}
    first, second = Ctx(), Ctx()
    older.attach(first)
    newer.attach(second)
    process.add_usage(10, 2)
    assert (first.usage, second.usage) == ([(10, 2)], [])
    older.finished_at = 3.0  # its ACP prompt answered: the other one runs alone
    process.add_usage(7, 1)
    assert second.usage == [(7, 1)]
    # A prompt parked on the application's permission keeps its usage for the turn that
    # drains it next.
    older.finished_at, older.ctx = None, None
    newer.finished_at = 4.0
    process.add_usage(3, 3)
    resumed = Ctx()
    older.attach(resumed)
    assert resumed.usage == [(3, 3)] and older.metered


# --- the configuration ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, where, words",
    [
        ({"options": {"apiKey": {"env": "OPENAI_API_KEY"}}}, "options/apiKey", "stays in the worker"),
        ({"options": {"apiKey": {"configOption": "key"}}}, "options/apiKey", "remove its route to configOption"),
        ({"env": {"U": "x"}}, "gateway/env", "U is also set in env"),
        ({"options": {"other": {"env": "K"}}}, "gateway/env", "route of option 'other'"),
        ({"gateway": {**GATEWAY_CONFIG["gateway"], "baseUrl": "ftp://x/v1"}}, "gateway/baseUrl", "http:// or https://"),
        ({"gateway": {**GATEWAY_CONFIG["gateway"], "baseUrl": "https://x/v1?k=1"}}, "gateway/baseUrl", "no query"),
        ({"gateway": {**GATEWAY_CONFIG["gateway"], "env": {"baseUrl": "HOME", "apiKey": "K"}}}, "gateway/env", "HOME"),
        ({"gateway": {**GATEWAY_CONFIG["gateway"], "env": {"baseUrl": "U"}}}, "gateway/env", "'apiKey' is a required"),
        ({"gateway": {**GATEWAY_CONFIG["gateway"], "keyOption": ""}}, "gateway/keyOption", ""),
    ],
)
def test_a_gateway_configuration_is_refused_with_a_sentence_naming_the_key(change, where, words):
    with pytest.raises(ValueError, match=f"Runtime configuration for 'acp' is invalid at '{where}'") as info:
        AcpRuntime.validate_config({**GATEWAY_CONFIG, **change})
    assert words in str(info.value)
