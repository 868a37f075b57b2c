"""The compose init service applies the operator's agents file with the environment compose
gives it: OPENAI_BASE_URL / OPENAI_MODEL / OPENAI_API_KEY from .env reach the `assistant` of
deploy/agents.example.yaml, uncommented as its comment tells the operator to."""

from __future__ import annotations

import re

import pytest
from django.core.management import call_command

from tests.compose_render import render
from tests.support import ROOT

REQUIRED = (
    "SECRET_KEY=s\nHOSTING_ENCRYPTION_KEYS=k\nPOSTGRES_PASSWORD=p\nPOSTGRES_WORKER_PASSWORD=w\nREDIS_PASSWORD=r\n"
)


def operators_agents_file(tmp_path):
    """deploy/agents.example.yaml with the assistant uncommented."""
    text = (ROOT / "deploy" / "agents.example.yaml").read_text()
    head, marker, tail = text.partition("#  - name: assistant")
    assert marker, "the example offers an assistant to uncomment"
    path = tmp_path / "agents.yaml"
    path.write_text(head + re.sub(r"^#(  .*)$", r"\1", marker + tail, flags=re.M))
    return path


def apply_as_init(dotenv: str, tmp_path, monkeypatch) -> dict:
    init_env = render(REQUIRED + dotenv)["services"]["init"]["resolved_environment"]
    for name in ("OPENAI_BASE_URL", "OPENAI_MODEL", "OPENAI_API_KEY"):
        if name in init_env:
            monkeypatch.setenv(name, init_env[name])
        else:
            monkeypatch.delenv(name, raising=False)
    call_command("apply_agents", str(operators_agents_file(tmp_path)), verbosity=0)
    from agents.models import Agent

    agent = Agent.objects.get(name="assistant")
    return {
        "options": {o.name: o.default_value() for o in agent.options.all()},
        "config": agent.runtime_config,
    }


@pytest.mark.django_db
def test_the_model_endpoint_in_env_reaches_the_assistant(tmp_path, monkeypatch):
    applied = apply_as_init(
        "OPENAI_BASE_URL=http://llm.internal:8080/v1\nOPENAI_MODEL=qwen2.5-7b-instruct\nOPENAI_API_KEY=sk-local-123\n",
        tmp_path,
        monkeypatch,
    )
    assert applied["options"] == {
        "model": "qwen2.5-7b-instruct",
        "apiKey": "sk-local-123",
        "baseUrl": "http://llm.internal:8080/v1",
    }


@pytest.mark.django_db
def test_without_them_the_assistant_uses_its_runtime_configuration(tmp_path, monkeypatch):
    applied = apply_as_init("OPENAI_API_KEY=sk-abc\n", tmp_path, monkeypatch)
    assert applied["options"] == {"model": "", "apiKey": "sk-abc", "baseUrl": ""}
    assert applied["config"]["model"] == "gpt-4o-mini"
    assert applied["config"]["baseUrl"] == "https://api.openai.com/v1"
