"""ACP shapes as AAP ones: tool kinds as server tools, stop reasons, a tool call's content as
the text of an AAP tool result, image data URIs as ACP image blocks."""

from __future__ import annotations

import json

from aap.types import StopReason

from .session import CallState

TOOL_KINDS = {
    "read": ("Read", "Read files or data."),
    "edit": ("Edit", "Create or modify files or content."),
    "delete": ("Delete", "Delete files or data."),
    "move": ("Move", "Move or rename files."),
    "search": ("Search", "Search for information."),
    "execute": ("Execute", "Run commands or code."),
    "think": ("Think", "Internal reasoning or planning."),
    "fetch": ("Fetch", "Retrieve external data."),
    "switch_mode": ("Switch mode", "Switch the agent's session mode."),
    "other": ("Other", "Any other tool of the agent."),
}

STOP_REASONS: dict[str, StopReason] = {
    "end_turn": "end_turn",
    "max_tokens": "max_tokens",
    "max_turn_requests": "max_tokens",
    "refusal": "refusal",
    "cancelled": "end_turn",
}


def tool_text(state: CallState, status: str | None) -> str:
    """A tool call's ACP content as the text of its AAP tool_result, saying what happened: a
    diff is an edit only when the call completed; a failed or unfinished call says so."""
    parts = []
    for item in state.content or []:
        if item.type == "content":
            block = item.content
            if block.type == "text":
                parts.append(block.text)
            elif block.type == "resource" and hasattr(block.resource, "text"):
                parts.append(block.resource.text)
            else:
                parts.append(f"[{block.type}]")
        elif item.type == "diff":
            parts.append(
                f"Edited {item.path}" if status == "completed" else f"Proposed edit to {item.path} (not applied)"
            )
        elif item.type == "terminal":
            parts.append(f"[terminal {item.terminal_id}]")
    text = "\n".join(parts)
    if not text and state.raw_output is not None:
        raw = state.raw_output
        text = raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)
    if status == "failed":
        return f"Tool call failed: {text}" if text else "Tool call failed."
    if status != "completed":
        return f"The tool call ended without a result. {text}".strip()
    return text or "Tool call completed."


def data_uri(url: str) -> tuple[str, str]:
    head, _, data = url.partition(",")
    return head[len("data:") :].split(";")[0], "".join(data.split())
