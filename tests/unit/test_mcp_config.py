"""MCP servers of an agent: what the configuration accepts, the names tools get, the values a
tenant's server receives, and how a tool result becomes AAP content."""

from __future__ import annotations

import mcp_types as types
import pytest

from agents.runtimes.mcp_config import TOOL_NAME_RE, resolve, tool_name
from agents.runtimes.openai import OpenAIRuntime
from agents.tools.mcp import content_of
from agents.validation import mcp_option_error


def refusal(servers) -> str:
    with pytest.raises(ValueError) as caught:
        OpenAIRuntime.validate_config({"mcpServers": servers})
    return str(caught.value)


def test_a_stdio_and_an_http_server_are_accepted():
    config = {
        "mcpServers": [
            {"name": "time", "command": "mcp-server-time", "env": [{"name": "TZ", "value": "UTC"}]},
            {
                "name": "tickets",
                "type": "http",
                "url": "https://mcp.example.com/mcp",
                "headers": [{"name": "Authorization", "option": "token", "prefix": "Bearer "}],
            },
        ]
    }
    assert OpenAIRuntime.validate_config(config) == config


@pytest.mark.parametrize(
    "servers, where, words",
    [
        ([{"name": "a", "command": "x"}, {"name": "a", "command": "y"}], "mcpServers/1/name", "two MCP servers"),
        ([{"name": "a"}], "mcpServers/0", "needs a 'command'"),
        ([{"name": "a", "type": "http", "url": "ftp://host/"}], "mcpServers/0/url", "http:// or https://"),
        ([{"name": "a", "type": "http", "url": "https://u:p@host/"}], "mcpServers/0/url", "without user"),
        ([{"name": "a", "command": "x", "url": "https://host/"}], "mcpServers/0/url", "not a setting of a stdio"),
        ([{"name": "a", "type": "http", "url": "https://h/", "command": "x"}], "mcpServers/0/command", "http"),
        (
            [{"name": "a", "type": "http", "url": "https://h/", "unsafeWithoutSandbox": True}],
            "mcpServers/0/unsafeWithoutSandbox",
            "not a setting of a http",
        ),
    ],
)
def test_what_the_schema_cannot_say_is_refused_with_where_and_why(servers, where, words):
    message = refusal(servers)
    assert f"at '{where}'" in message and words in message


def test_the_schema_refuses_bad_names_and_a_value_with_a_prefix():
    assert "mcpServers/0/name" in refusal([{"name": "has space", "command": "x"}])
    assert "mcpServers/0/env/0" in refusal(
        [{"name": "a", "command": "x", "env": [{"name": "K", "value": "v", "prefix": "p"}]}]
    )


def test_tool_names_are_prefixed_valid_stable_and_never_collide():
    assert tool_name("time", "get_current_time", set()) == "time__get_current_time"
    taken = {"time__get_current_time"}
    other = tool_name("time", "get_current_time", taken)
    assert other != "time__get_current_time" and other == tool_name("time", "get_current_time", taken)
    odd = tool_name("files", "read.file/v2", set())
    long = tool_name("s", "x" * 100, set())
    assert TOOL_NAME_RE.match(odd) and TOOL_NAME_RE.match(long) and len(long) <= 64
    assert tool_name("s", "x" * 100, set()) != tool_name("s", "x" * 99 + "y", set())


def test_option_values_fill_env_and_headers_and_an_empty_one_is_left_out():
    entries = [
        {"name": "Authorization", "option": "token", "prefix": "Bearer "},
        {"name": "X-Static", "value": "1"},
        {"name": "X-Empty", "option": "unset"},
    ]
    assert resolve(entries, {"token": "sk-tenant", "unset": ""}) == {
        "Authorization": "Bearer sk-tenant",
        "X-Static": "1",
    }


def test_an_option_the_agent_does_not_declare_is_refused():
    config = {"mcpServers": [{"name": "a", "command": "x", "env": [{"name": "K", "option": "key"}]}]}
    assert "'key'" in mcp_option_error(config, [{"name": "model"}])
    assert mcp_option_error(config, [{"name": "key", "type": "secret"}]) is None


def test_results_map_to_aap_content():
    text = types.CallToolResult(content=[types.TextContent(text="12:00")])
    assert content_of(text) == "12:00"
    picture = types.CallToolResult(
        content=[types.TextContent(text="a dot"), types.ImageContent(data="iVBOR", mime_type="image/png")]
    )
    assert content_of(picture) == [
        {"type": "text", "text": "a dot"},
        {"type": "image", "url": "data:image/png;base64,iVBOR"},
    ]
    structured = types.CallToolResult(content=[], structured_content={"hour": 12})
    assert content_of(structured) == '{"hour": 12}'
    failed = types.CallToolResult(content=[types.TextContent(text="no such zone")], is_error=True)
    assert content_of(failed) == "Error: no such zone"
    resource = types.CallToolResult(
        content=[
            types.EmbeddedResource(
                resource=types.TextResourceContents(uri="file:///a.txt", text="inside", mime_type="text/plain")
            )
        ]
    )
    assert content_of(resource) == "inside"


def test_a_stdio_server_runs_in_its_sandbox_unless_the_operator_opts_out():
    from pathlib import Path

    from agents.mcp.connection import process_spec
    from agents.runtimes.mcp_config import Server

    def spec(**more):
        server = Server.parse({"name": "p", "command": "probe", "readPaths": ["/opt/probe"], **more})
        return process_spec(server, key="k", label="a/p", unit="mcp-u", home=Path("/w/home"), env={})

    assert spec().sandbox.writable == (Path("/w/home"),) and spec().sandbox.read_paths == ("/opt/probe",)
    assert spec(unsafeWithoutSandbox=False).sandbox is not None
    assert spec(unsafeWithoutSandbox=True).sandbox is None  # unconfined: ServerProcess.spawn logs a warning
    config = {"mcpServers": [{"name": "p", "command": "probe", "unsafeWithoutSandbox": True}]}
    assert OpenAIRuntime.validate_config(config) == config
