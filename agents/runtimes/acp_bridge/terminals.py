"""`terminal/*` for ACP agents: commands run in the session's workspace, in the agent's own
sandbox (never as the worker), with a timeout and an output byte limit, in their own process
group so a kill reaches their children too."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from pathlib import Path
from typing import TypedDict

import acp

from .sandbox import SandboxError, sandbox_path
from .workspace import WorkspaceError, confined_dir


def _trim(data: bytearray, limit: int) -> bool:
    """Drop bytes from the start to fit `limit`, never splitting a UTF-8 character."""
    if len(data) <= limit:
        return False
    cut = len(data) - limit
    while cut < len(data) and (data[cut] & 0xC0) == 0x80:
        cut += 1
    del data[:cut]
    return True


class ExitStatus(TypedDict):
    """ACP's TerminalExitStatus, as sent."""

    exitCode: int | None
    signal: str | None


def _exit_status(code: int) -> ExitStatus:
    if code < 0:
        return {"exitCode": None, "signal": signal.Signals(-code).name}
    return {"exitCode": code, "signal": None}


class Terminal:
    def __init__(self, process: asyncio.subprocess.Process, limit: int, timeout: float):
        if process.stdout is None:
            raise ValueError("a terminal's output must be piped")
        self.process = process
        self.limit = limit
        self.output = bytearray()
        self.truncated = False
        self.timed_out = False
        self._reader = asyncio.create_task(self._read(process.stdout))
        self._timer = asyncio.get_running_loop().call_later(timeout, self._time_out)

    async def _read(self, stdout: asyncio.StreamReader) -> None:
        while chunk := await stdout.read(65536):
            self.output.extend(chunk)
            self.truncated = _trim(self.output, self.limit) or self.truncated

    def _time_out(self) -> None:
        self.timed_out = True
        self.kill()

    def kill(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)

    def exit_status(self) -> ExitStatus | None:
        code = self.process.returncode
        return None if code is None else _exit_status(code)

    async def wait(self) -> ExitStatus:
        code = await self.process.wait()
        await self._reader
        self._timer.cancel()
        return _exit_status(code)

    def text(self) -> str:
        return bytes(self.output).decode("utf-8", errors="replace")


class Terminals:
    """The terminals of one ACP session."""

    def __init__(self, workspace: Path, *, timeout: float, max_output: int, confine=None):
        self.workspace = workspace
        self.confine = confine  # (argv, cwd, env) -> (argv, env, env_fd) under the agent's own sandbox
        self.timeout = timeout
        self.max_output = max_output
        self._terminals: dict[str, Terminal] = {}

    def _get(self, terminal_id: str) -> Terminal:
        terminal = self._terminals.get(terminal_id)
        if terminal is None:
            raise acp.RequestError.invalid_params({"terminalId": "unknown terminal"})
        return terminal

    async def create(
        self, command: str, args: list[str] | None, env: list | None, cwd: str | None, output_byte_limit: int | None
    ) -> str:
        try:
            directory = confined_dir(self.workspace, cwd)
        except WorkspaceError as exc:
            raise acp.RequestError(exc.code, str(exc)) from None
        environment = {"PATH": sandbox_path(), "LANG": "C.UTF-8", "HOME": str(self.workspace)}
        environment.update({item.name: item.value for item in env or []})
        argv = [command, *(args or [])]
        env_fd = None
        try:
            if self.confine is not None:  # the agent's environment reaches the command as data only
                argv, environment, env_fd = self.confine(argv, directory, environment)
            process = await asyncio.create_subprocess_exec(
                *argv,
                cwd=directory,
                env=environment,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                pass_fds=(env_fd,) if env_fd is not None else (),
            )
        except (OSError, SandboxError) as exc:
            raise acp.RequestError.invalid_params({"command": f"cannot run ({type(exc).__name__})"}) from None
        finally:
            if env_fd is not None:
                os.close(env_fd)
        limit = min(int(output_byte_limit), self.max_output) if output_byte_limit else self.max_output
        terminal_id = "term_" + uuid.uuid4().hex
        self._terminals[terminal_id] = Terminal(process, limit, self.timeout)
        return terminal_id

    def output(self, terminal_id: str) -> dict:
        terminal = self._get(terminal_id)
        return {"output": terminal.text(), "truncated": terminal.truncated, "exitStatus": terminal.exit_status()}

    async def wait(self, terminal_id: str) -> ExitStatus:
        return await self._get(terminal_id).wait()

    def kill(self, terminal_id: str) -> None:
        self._get(terminal_id).kill()

    def release(self, terminal_id: str) -> None:
        terminal = self._terminals.pop(terminal_id, None)
        if terminal is not None:
            terminal.kill()

    def close(self) -> None:
        for terminal_id in list(self._terminals):
            self.release(terminal_id)
