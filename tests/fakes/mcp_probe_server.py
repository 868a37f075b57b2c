"""A real MCP server (the `mcp` SDK's MCPServer) for the tests: stdio by default, streamable
HTTP with `--http PORT` (on 127.0.0.1, path /mcp).

Tools: `sh` runs a shell command in the server's working directory and answers
`exit=N` and its output (what a filesystem or shell MCP server could do); `env` answers an
environment variable, `header` a header of the HTTP request; `picture` answers a text and a 1x1 PNG; `fail` answers an error result;
`crash` exits the process mid-call; `grow` adds a tool and sends `notifications/tools/list_changed`; `sleep` sleeps (a call to time out or cancel; a
call leaves `sleep-started` in its working directory, a cancelled one `sleep-cancelled`). With PROBE_TOKEN=exit-at-start it exits before serving.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
from pathlib import Path

import mcp_types as types
from mcp.server.mcpserver import Context, MCPServer

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="

server = MCPServer("probe")


@server.tool(description="Runs a shell command in the server's working directory.")
def sh(command: str) -> str:
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
    return f"exit={done.returncode}\n{done.stdout}{done.stderr}"


@server.tool(description="The value of an environment variable ('' when unset).")
def env(name: str) -> str:
    return os.environ.get(name, "")


@server.tool(description="The value of a header of the HTTP request carrying this call ('' over stdio).")
def header(name: str, ctx: Context) -> str:
    request = ctx.request_context.request
    return request.headers.get(name, "") if request is not None else ""


@server.tool(description="A caption and a tiny picture.")
def picture() -> list:
    return [types.TextContent(text="a red dot"), types.ImageContent(data=PNG, mime_type="image/png")]


@server.tool(description="Always fails.")
def fail() -> str:
    raise ValueError("the probe was asked to fail")


@server.tool(description="Exits the server in the middle of the call.")
def crash() -> str:
    os._exit(3)


@server.tool(description="Sleeps, then answers (a cancelled call leaves the file sleep-cancelled).")
async def sleep(seconds: float) -> str:
    Path("sleep-started").write_text("started\n")
    try:
        await asyncio.sleep(seconds)
    except BaseException:
        Path("sleep-cancelled").write_text("cancelled\n")
        raise
    return "slept"


@server.tool(description="Adds a tool of that name (answering 'grown') and tells the client its list changed.")
async def grow(name: str, ctx: Context) -> str:
    server.add_tool(lambda: "grown", name=name, description="A tool added while serving.")
    await ctx.session.send_tool_list_changed()
    return f"added {name}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, default=None)
    port = parser.parse_args().http
    if os.environ.get("PROBE_TOKEN") == "exit-at-start":  # a server that will not start
        raise SystemExit(4)
    if port is None:
        server.run()
    else:
        server.run("streamable-http", host="127.0.0.1", port=port)
