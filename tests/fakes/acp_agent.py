"""A small scripted ACP agent for the test suite, built on the `agent-client-protocol` SDK.

Run it as `python -m tests.fakes.acp_agent`. The prompt text drives it:

    plain text            -> "echo: T", one agent_message_chunk per word
    /think X              -> thought "thinking about: X", then "echo: X"
    /tool                 -> a `read` tool call, an in_progress update, a completed update, "done"
    /write PATH TEXT      -> an `edit` tool call asking permission; when allowed it writes
                             TEXT to <cwd>/PATH through fs/write_text_file
    /perm KIND            -> a KIND tool call asking permission; reports the chosen option
    /staged [MODE]        -> an `execute` tool call whose input comes in parts, as OpenCode sends
                             it: the tool_call has {"cwd"}, a tool_call_update adds "command",
                             then a permission request whose toolCall carries only the id and a
                             title. MODE `change`: once <cwd>/go exists it sends one more update
                             with another command (then writes <cwd>/changed); `late`: it changes
                             the command after the answer. Ends "ran: CMD" or "not run: CMD".
    /read PATH            -> fs/read_text_file of PATH (joined to cwd unless absolute)
    /readraw PATH         -> fs/read_text_file of PATH exactly as given
    /writeraw PATH TEXT   -> fs/write_text_file of PATH exactly as given, no permission
    /terminal [NAME=VALUE...] CMD ARGS...
                          -> terminal/create (with that environment), wait_for_exit, output, release
    /unknown              -> calls a client method that does not exist, then goes on
    /plan                 -> plan, available_commands_update, current_mode_update and
                             user_message_chunk updates, then "planned"
    /stop REASON          -> "stopping", then the stop reason REASON
    /slow N MS            -> "tick 1 ", "tick 2 ", ... MS milliseconds apart (honours cancel)
    /hang                 -> never answers (until cancelled)
    /exit                 -> the process exits at once
    /garbage              -> writes a line that is not JSON to stdout, then hangs
    /env VAR              -> "VAR=<first 12 hex of sha256(value)>" or "VAR=unset"
    /pid                  -> "pid=<process id> ns=<its PID namespace>"
    /sh CMD               -> runs `/bin/sh -c CMD` in cwd; one message "exit=N\n<output>"
    /failedit PATH        -> an `edit` tool call with a diff that the agent reports as failed
    /whoami               -> session id, model option, loaded flag, MCP server names, cwd
    /llm [--stream] [--key K] TEXT
                          -> one chat completion (model = the model option) from
                             $FAKE_MODEL_URL with $FAKE_API_KEY (K instead with --key), through
                             the proxy variables like any agent's client: "status=N text=..."
                             (streamed: also "usage_chunks=N", the usage-only chunks it got)

FAKE_ACP_LOAD_SESSION=1 makes it declare `loadSession`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import sys
import uuid
from pathlib import Path

import acp
from acp import schema


def _words(text: str) -> list[str]:
    out, word = [], ""
    for char in text:
        word += char
        if char == " ":
            out.append(word)
            word = ""
    if word:
        out.append(word)
    return out


PERMISSION_OPTIONS = [
    schema.PermissionOption(option_id="allow-once", name="Allow once", kind="allow_once"),
    schema.PermissionOption(option_id="allow-always", name="Always allow", kind="allow_always"),
    schema.PermissionOption(option_id="reject-once", name="Reject once", kind="reject_once"),
    schema.PermissionOption(option_id="reject-always", name="Always reject", kind="reject_always"),
]


class _Session:
    def __init__(self, session_id: str, cwd: str, mcp: list[str], loaded: bool = False):
        self.id = session_id
        self.cwd = cwd
        self.mcp = mcp
        self.loaded = loaded
        self.model = "fast"
        self.cancelled = asyncio.Event()


class FakeAgent:
    def __init__(self):
        self.conn = None
        self.sessions: dict[str, _Session] = {}
        self.client_capabilities = None
        self.tool_seq = 0

    def on_connect(self, conn) -> None:
        self.conn = conn

    # --- agent methods -----------------------------------------------------------------

    async def initialize(self, protocol_version, client_capabilities=None, client_info=None, **kwargs):
        self.client_capabilities = client_capabilities
        return schema.InitializeResponse(
            protocol_version=1,
            agent_capabilities=schema.AgentCapabilities(
                load_session=os.environ.get("FAKE_ACP_LOAD_SESSION") == "1",
                prompt_capabilities=schema.PromptCapabilities(image=True),
            ),
            agent_info=schema.Implementation(name="fake-acp", title="Fake ACP agent", version="1.0.0"),
        )

    def _config_options(self, session: _Session):
        return [
            schema.SessionConfigOptionSelect(
                id="model",
                name="Model",
                type="select",
                category="model",
                current_value=session.model,
                options=[schema.SessionConfigSelectOption(value=v, name=v) for v in ("fast", "smart")],
            )
        ]

    async def new_session(self, cwd, mcp_servers=None, **kwargs):
        session = _Session("fake_" + uuid.uuid4().hex, cwd, [s.name for s in mcp_servers or []])
        self.sessions[session.id] = session
        return schema.NewSessionResponse(session_id=session.id, config_options=self._config_options(session))

    async def load_session(self, cwd, session_id, mcp_servers=None, **kwargs):
        session = _Session(session_id, cwd, [s.name for s in mcp_servers or []], loaded=True)
        self.sessions[session_id] = session
        # A real agent replays the conversation; the client must not treat it as a new turn.
        await self.conn.session_update(session_id, acp.update_user_message_text("(replayed question)"))
        await self.conn.session_update(session_id, acp.update_agent_message_text("(replayed answer)"))
        return schema.LoadSessionResponse(config_options=self._config_options(session))

    async def set_config_option(self, config_id, session_id, value, **kwargs):
        session = self.sessions[session_id]
        if config_id != "model":
            raise acp.RequestError.invalid_params({"configId": config_id})
        session.model = value
        return schema.SetSessionConfigOptionResponse(config_options=self._config_options(session))

    async def cancel(self, session_id, **kwargs):
        session = self.sessions.get(session_id)
        if session is not None:
            session.cancelled.set()

    async def authenticate(self, method_id, **kwargs):
        return None

    async def prompt(self, prompt, session_id, **kwargs):
        session = self.sessions[session_id]
        session.cancelled.clear()
        text = "\n".join(block.text for block in prompt if getattr(block, "type", "") == "text")
        images = sum(1 for block in prompt if getattr(block, "type", "") == "image")
        command, _, rest = text.partition(" ")
        handler = getattr(self, "_cmd_" + command[1:], None) if command.startswith("/") else None
        if handler is None:
            reply = f"echo: {text}" + (f" [images: {images}]" if images else "")
            await self._say(session, reply)
            return schema.PromptResponse(stop_reason="end_turn")
        stop = await handler(session, rest)
        return schema.PromptResponse(stop_reason=stop or "end_turn")

    # --- helpers -----------------------------------------------------------------------

    async def _say(self, session: _Session, text: str, thought: bool = False) -> None:
        for word in _words(text):
            update = acp.update_agent_thought_text(word) if thought else acp.update_agent_message_text(word)
            await self.conn.session_update(session.id, update)

    def _path(self, session: _Session, path: str) -> str:
        return path if path.startswith("/") else session.cwd.rstrip("/") + "/" + path

    async def _tool(self, session: _Session, kind: str, title: str, raw_input: dict) -> str:
        self.tool_seq += 1
        call_id = f"tool_{self.tool_seq}_{uuid.uuid4().hex[:6]}"
        await self.conn.session_update(
            session.id, acp.start_tool_call(call_id, title, kind=kind, status="pending", raw_input=raw_input)
        )
        return call_id

    async def _finish_tool(self, session: _Session, call_id: str, text: str, ok: bool = True) -> None:
        await self.conn.session_update(
            session.id,
            acp.update_tool_call(
                call_id, status="completed" if ok else "failed", content=[acp.tool_content(acp.text_block(text))]
            ),
        )

    async def _ask(self, session: _Session, call_id: str, kind: str, title: str, raw_input: dict) -> str | None:
        response = await self.conn.request_permission(
            session.id,
            schema.ToolCallUpdate(tool_call_id=call_id, kind=kind, title=title, raw_input=raw_input),
            PERMISSION_OPTIONS,
        )
        outcome = response.outcome
        return outcome.option_id if outcome.outcome == "selected" else None

    # --- commands ----------------------------------------------------------------------

    async def _cmd_think(self, session, rest):
        await self._say(session, f"thinking about: {rest}", thought=True)
        await self._say(session, f"echo: {rest}")

    async def _cmd_tool(self, session, rest):
        call_id = await self._tool(session, "read", "Read README", {"path": "README"})
        await self.conn.session_update(session.id, acp.update_tool_call(call_id, status="in_progress"))
        await self._finish_tool(session, call_id, "README contents")
        await self._say(session, "done")

    async def _cmd_write(self, session, rest):
        path, _, content = rest.partition(" ")
        raw_input = {"path": path, "content": content}
        call_id = await self._tool(session, "edit", f"Write {path}", raw_input)
        choice = await self._ask(session, call_id, "edit", f"Write {path}", raw_input)
        if choice not in ("allow-once", "allow-always"):
            await self._finish_tool(session, call_id, "permission rejected", ok=False)
            await self._say(session, f"not allowed to write {path}")
            return "cancelled" if session.cancelled.is_set() else "end_turn"
        try:
            await self.conn.write_text_file(session.id, self._path(session, path), content)
        except acp.RequestError as exc:
            await self._finish_tool(session, call_id, f"error {exc.code}", ok=False)
            await self._say(session, f"write failed: {exc.code}")
            return None
        await self._finish_tool(session, call_id, f"wrote {path}")
        await self._say(session, f"wrote {path}")

    async def _cmd_perm(self, session, rest):
        kind = rest.strip() or "other"
        call_id = await self._tool(session, kind, f"Use {kind}", {"kind": kind})
        choice = await self._ask(session, call_id, kind, f"Use {kind}", {"kind": kind})
        await self._finish_tool(session, call_id, f"option {choice}", ok=bool(choice and choice.startswith("allow")))
        await self._say(session, f"permission {kind}: {choice or 'cancelled'}")

    async def _cmd_staged(self, session, rest):
        mode = rest.strip()
        self.tool_seq += 1
        call_id = f"tool_{self.tool_seq}_{uuid.uuid4().hex[:6]}"
        command = "echo staged"
        await self.conn.session_update(
            session.id,
            acp.start_tool_call(call_id, "bash", kind="execute", status="pending", raw_input={"cwd": session.cwd}),
        )
        await self.conn.session_update(
            session.id,
            acp.update_tool_call(
                call_id,
                title=command,
                raw_input={"cwd": session.cwd, "command": command},
                locations=[schema.ToolCallLocation(path=session.cwd)],
            ),
        )
        asking = asyncio.ensure_future(
            self.conn.request_permission(
                session.id, schema.ToolCallUpdate(tool_call_id=call_id, title=f"Run {command}"), PERMISSION_OPTIONS
            )
        )
        while mode == "change" and not asking.done():
            if os.path.exists(os.path.join(session.cwd, "go")):
                command = "echo changed"
                await self.conn.session_update(
                    session.id, acp.update_tool_call(call_id, raw_input={"cwd": session.cwd, "command": command})
                )
                Path(session.cwd, "changed").write_text(command)
                break
            await asyncio.sleep(0.05)
        outcome = (await asking).outcome
        if outcome.outcome != "selected" or not outcome.option_id.startswith("allow"):
            await self._finish_tool(session, call_id, "refused", ok=False)
            await self._say(session, f"not run: {command}")
            return None
        if mode == "late":
            command = "echo late"
            await self.conn.session_update(
                session.id,
                acp.update_tool_call(call_id, status="in_progress", raw_input={"cwd": session.cwd, "command": command}),
            )
        await self._finish_tool(session, call_id, f"ran: {command}")
        await self._say(session, f"ran: {command}")
        return None

    async def _read(self, session, path):
        try:
            response = await self.conn.read_text_file(session.id, path)
        except acp.RequestError as exc:
            await self._say(session, f"read failed: {exc.code}")
            return
        await self._say(session, f"read: {response.content}")

    async def _cmd_read(self, session, rest):
        await self._read(session, self._path(session, rest.strip()))

    async def _cmd_readraw(self, session, rest):
        await self._read(session, rest.strip())

    async def _cmd_writeraw(self, session, rest):
        path, _, content = rest.partition(" ")
        try:
            await self.conn.write_text_file(session.id, path, content)
        except acp.RequestError as exc:
            await self._say(session, f"write failed: {exc.code}")
            return
        await self._say(session, f"wrote {path}")

    async def _cmd_terminal(self, session, rest):
        words = rest.split()
        env = []  # leading NAME=VALUE words: the terminal's environment, as an agent may ask
        while words and "=" in words[0] and not words[0].startswith("/"):
            name, _, value = words.pop(0).partition("=")
            env.append(schema.EnvVariable(name=name, value=value))
        command, *args = words
        try:
            created = await self.conn.create_terminal(session.id, command, args=args, cwd=session.cwd, env=env or None)
            if created is None:  # a client without terminal support may answer null
                raise acp.RequestError(-32601, "no terminal")
            terminal = created.terminal_id
            await self.conn.wait_for_terminal_exit(session.id, terminal)
            output = await self.conn.terminal_output(session.id, terminal)
            await self.conn.release_terminal(session.id, terminal)
        except acp.RequestError as exc:
            await self._say(session, f"terminal failed: {exc.code}")
            return
        status = output.exit_status
        await self._say(session, f"exit={status.exit_code if status else None} output={output.output.strip()}")

    async def _cmd_unknown(self, session, rest):
        try:
            await self.conn._conn.send_request("fs/delete_everything", {"sessionId": session.id})
        except acp.RequestError as exc:
            await self._say(session, f"unknown method error {exc.code}; ")
        await self._say(session, "still here")

    async def _cmd_plan(self, session, rest):
        await self.conn.session_update(
            session.id, acp.update_plan([acp.plan_entry("look around"), acp.plan_entry("answer", status="in_progress")])
        )
        await self.conn.session_update(
            session.id,
            schema.AvailableCommandsUpdate(
                session_update="available_commands_update",
                available_commands=[schema.AvailableCommand(name="plan", description="Make a plan")],
            ),
        )
        await self.conn.session_update(
            session.id, schema.CurrentModeUpdate(session_update="current_mode_update", current_mode_id="code")
        )
        await self.conn.session_update(session.id, acp.update_user_message_text("(user echo)"))
        await self._say(session, "planned")

    async def _cmd_stop(self, session, rest):
        await self._say(session, "stopping")
        return rest.strip()

    async def _cmd_slow(self, session, rest):
        count, _, pause = rest.partition(" ")
        for i in range(1, int(count) + 1):
            if i > 1:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(session.cancelled.wait(), int(pause or 0) / 1000)
            if session.cancelled.is_set():
                return "cancelled"
            await self.conn.session_update(session.id, acp.update_agent_message_text(f"tick {i} "))

    async def _cmd_hang(self, session, rest):
        await session.cancelled.wait()
        return "cancelled"

    async def _cmd_exit(self, session, rest):
        os._exit(3)

    async def _cmd_garbage(self, session, rest):
        sys.stdout.buffer.write(b"this is not JSON-RPC\n")
        sys.stdout.buffer.flush()
        await session.cancelled.wait()
        return "cancelled"

    async def _cmd_env(self, session, rest):
        name = rest.strip()
        value = os.environ.get(name)
        digest = hashlib.sha256(value.encode()).hexdigest()[:12] if value else "unset"
        await self._say(session, f"{name}={digest}")

    async def _cmd_sh(self, session, rest):
        # Runs whatever the test scripts, as the agent's own tools would: the sandbox must hold.
        process = await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            rest,
            cwd=session.cwd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            output, _ = await asyncio.wait_for(process.communicate(), 60)
        except TimeoutError:
            process.kill()
            output = b"(timed out)"
        text = output.decode("utf-8", errors="replace")[-20000:]
        await self.conn.session_update(session.id, acp.update_agent_message_text(f"exit={process.returncode}\n{text}"))

    async def _cmd_failedit(self, session, rest):
        # An edit the agent itself reports as failed (as Agentao does for a refused write).
        path = self._path(session, rest.strip() or "refused.txt")
        call_id = f"tool_{uuid.uuid4().hex[:6]}"
        diff = schema.FileEditToolCallContent(type="diff", path=path, old_text=None, new_text="new text")
        await self.conn.session_update(
            session.id,
            acp.start_tool_call(
                call_id, "write_file", kind="edit", status="pending", raw_input={"path": path}, content=[diff]
            ),
        )
        await self.conn.session_update(
            session.id,
            acp.update_tool_call(
                call_id, status="failed", content=[acp.tool_content(acp.text_block("Permission denied by the user."))]
            ),
        )
        await self._say(session, "not written")

    async def _cmd_llm(self, session, rest):
        import httpx

        words = rest.split()
        stream = "--stream" in words
        key = os.environ.get("FAKE_API_KEY", "")
        if "--key" in words:
            key = words[words.index("--key") + 1]
            words.remove(key)
        text = " ".join(w for w in words if w not in ("--stream", "--key"))
        body = {"model": session.model, "messages": [{"role": "user", "content": text}], "stream": stream}
        url = os.environ.get("FAKE_MODEL_URL", "").rstrip("/") + "/chat/completions"
        headers = {"Authorization": f"Bearer {key}"}
        async with (
            httpx.AsyncClient(timeout=60) as client,
            client.stream("POST", url, json=body, headers=headers) as response,
        ):
            raw = await response.aread()
        if response.status_code != 200:
            await self._say(session, f"status={response.status_code} error={raw.decode(errors='replace')}")
            return
        if not stream:
            reply = response.json()["choices"][0]["message"]["content"]
            await self._say(session, f"status=200 text={reply}")
            return
        parts, usage_chunks = [], 0
        for line in raw.decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not chunk["choices"]:
                usage_chunks += 1
                continue
            parts.append(chunk["choices"][0]["delta"].get("content") or "")
        await self._say(session, f"status=200 text={''.join(parts)} usage_chunks={usage_chunks}")

    async def _cmd_pid(self, session, rest):
        # Its PID namespace too: in its own one, the host knows it by another number.
        await self._say(session, f"pid={os.getpid()} ns={os.readlink('/proc/self/ns/pid')}")

    async def _cmd_whoami(self, session, rest):
        await self._say(
            session,
            f"session={session.id} model={session.model} loaded={session.loaded} "
            f"mcp={','.join(session.mcp) or '-'} cwd={session.cwd}",
        )


def main() -> None:
    asyncio.run(acp.run_agent(FakeAgent()))


if __name__ == "__main__":
    main()
