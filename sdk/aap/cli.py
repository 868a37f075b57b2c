"""`aap`: talk to any AAP server from a terminal.

export AAP_URL=http://127.0.0.1:8000/v1 AAP_TOKEN=aap_...
aap meta                        # the agents this token may use
aap chat --agent echo           # a conversation, streamed; asks y/n for tool permissions
aap sessions                    # this tenant's sessions, newest first
aap history SESSION_ID          # a session's full history
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

import httpx

from .client import AAPError, Client, TurnResult
from .types import Event

DIM, RESET = "\033[2m", "\033[0m"


class Printer:
    """Writes a turn's events to the terminal as they arrive."""

    def __init__(self, out: TextIO, color: bool):
        self.out = out
        self.color = color
        self.open: str | None = None  # the kind of text being written: "text" / "thinking"

    def _dim(self, text: str) -> str:
        return f"{DIM}{text}{RESET}" if self.color else text

    def _start(self, kind: str) -> None:
        if self.open != kind:
            self._end()
            self.out.write("agent> " if kind == "text" else self._dim("thinking> "))
            self.open = kind

    def _end(self) -> None:
        if self.open is not None:
            self.out.write("\n")
            self.open = None

    def __call__(self, event: Event) -> None:
        name = event.event
        if name in ("text_delta", "text"):
            self._start("text")
            self.out.write(event.text)
        elif name in ("thinking_delta", "thinking"):
            self._start("thinking")
            self.out.write(self._dim(event.text))
        elif name == "tool_call":
            self._end()
            self.out.write(self._dim(f"[tool call] {event.data['name']}({json.dumps(event.data['input'])})") + "\n")
        elif name == "tool_result":
            self._end()
            self.out.write(self._dim(f"[tool result] {_short(event.data['content'])}") + "\n")
        elif name == "turn_stop":
            self._end()
            reason = event.data.get("stopReason")
            error = event.meta.get("error")
            if reason not in ("end_turn", "tool_use") or error:
                self.out.write(self._dim(f"[{reason}{': ' + error if error else ''}]") + "\n")
        self.out.flush()


def result_events(result: TurnResult) -> list[Event]:
    """A JSON turn's messages as the message-mode events that stand for them."""
    events = []
    for message in result.messages:
        if message["role"] == "tool":
            events.append(Event("tool_result", {"toolCallId": message["toolCallId"], "content": message["content"]}))
            continue
        content = message["content"]
        for block in [{"type": "text", "text": content}] if isinstance(content, str) else content:
            if block["type"] in ("text", "thinking"):
                events.append(Event(block["type"], {block["type"]: block[block["type"]]}))
            elif block["type"] == "tool_use":
                events.append(Event("tool_call", {k: block[k] for k in ("toolCallId", "name", "input")}))
    return [*events, Event("turn_stop", {"stopReason": result.stop_reason, "_meta": result.meta})]


def _short(content: Any) -> str:
    text = content if isinstance(content, str) else json.dumps(content)
    return text if len(text) <= 200 else text[:200] + "…"


def _ask(prompt: str, out: TextIO) -> str | None:
    out.write(prompt)
    out.flush()
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\n")


def _options(pairs: list[str]) -> dict[str, Any]:
    options = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"aap: --option takes NAME=VALUE (got {pair!r})")
        options[name] = value
    return options


def cmd_meta(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    for agent in client.meta()["agents"]:
        title = f" — {agent['title']}" if agent.get("title") else ""
        out.write(f"{agent['name']} {agent['version']}{title}\n")
        for option in agent.get("options", []):
            choices = f" {option['options']}" if option.get("options") else ""
            out.write(f"    option {option['name']} ({option['type']}{choices}) default {option['default']!r}\n")
        for tool in agent.get("tools", []):
            out.write(f"    tool {tool['name']}: {tool.get('description', '')}\n")
    return 0


def cmd_sessions(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    for index, session in enumerate(client.sessions()):
        if args.limit and index >= args.limit:
            break
        out.write(f"{session['sessionId']}  {session['agent']['name']}\n")
    return 0


def cmd_history(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    for message in client.history(args.session, args.type):
        out.write(json.dumps(message, ensure_ascii=False) + "\n")
    return 0


def cmd_chat(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    server_tools = [{"name": name, "trust": False} for name in args.tool] + [
        {"name": name, "trust": True} for name in args.trust
    ]
    session = args.session or client.create_session(
        args.agent, options=_options(args.option) or None, server_tools=server_tools or None
    )
    out.write(f"session {session} (empty line or Ctrl-D to leave)\n")
    printer = Printer(out, color=out.isatty() and not args.no_color)

    def permit(call: dict[str, Any]) -> bool:
        if args.yes:
            return True
        answer = _ask(f"Allow {call['name']}({json.dumps(call['input'])})? [y/N] ", out)
        return (answer or "").strip().lower() in ("y", "yes")

    pending = args.message
    while True:
        text = pending if pending is not None else _ask("you> ", out)
        if not text:
            return 0
        results = client.converse(session, text, permit=permit, stream=args.stream, on_event=printer)
        if args.stream == "none":  # no events: print each turn's answer whole
            for result in results:
                for event in result_events(result):
                    printer(event)
        if pending is not None:
            return 0


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    parser = argparse.ArgumentParser(prog="aap", description="Talk to an AAP server (AAP_URL, AAP_TOKEN).")
    parser.add_argument("--url", help="the server's AAP base URL, ending in /v1 (default: $AAP_URL)")
    parser.add_argument("--token", help="an API token (default: $AAP_TOKEN)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("meta", help="list the agents this token may use")
    sessions = commands.add_parser("sessions", help="list sessions, newest first")
    sessions.add_argument("--limit", type=int, default=50)
    history = commands.add_parser("history", help="print a session's history, one JSON message per line")
    history.add_argument("session")
    history.add_argument("--type", choices=["full", "compacted"], default="full")
    chat = commands.add_parser("chat", help="talk to an agent")
    chat.add_argument("--agent", default="echo")
    chat.add_argument("--session", help="continue this session instead of creating one")
    chat.add_argument("--option", action="append", default=[], metavar="NAME=VALUE")
    chat.add_argument(
        "--tool", action="append", default=[], metavar="NAME", help="enable a server tool (asks permission)"
    )
    chat.add_argument("--trust", action="append", default=[], metavar="NAME", help="enable a trusted server tool")
    chat.add_argument("--stream", choices=["delta", "message", "none"], default="delta")
    chat.add_argument("-m", "--message", help="send one message and exit")
    chat.add_argument("-y", "--yes", action="store_true", help="grant every tool permission without asking")
    chat.add_argument("--no-color", action="store_true")
    args = parser.parse_args(argv)
    try:
        with Client(args.url, args.token) as client:
            handler = {"meta": cmd_meta, "sessions": cmd_sessions, "history": cmd_history, "chat": cmd_chat}
            return handler[args.command](client, args, out)
    except AAPError as exc:
        print(f"aap: {exc.message} (HTTP {exc.status})" if exc.status else f"aap: {exc.message}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"aap: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except httpx.HTTPError as exc:
        print(f"aap: cannot reach the server: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
