import json

from django.contrib import admin
from django.template.loader import render_to_string

from .models import Message, Session, Turn


def _llm_usage(obj) -> str:
    return f"{obj.prompt_tokens} prompt + {obj.completion_tokens} completion"


class TurnInline(admin.TabularInline):
    model = Turn
    extra = 0
    fields = ("id", "status", "stream", "stop_reason", "cancelled", "error", "llm_usage", "created_at", "finished_at")
    readonly_fields = fields
    can_delete = False
    ordering = ("-created_at",)

    def has_add_permission(self, request, obj=None):
        return False

    @admin.display(description="LLM usage (tokens)")
    def llm_usage(self, obj):
        return _llm_usage(obj)


def _blocks(content) -> list[dict]:
    """A message's content as display blocks; images show their kind, never their bytes."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    blocks = []
    for block in content if isinstance(content, list) else []:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("text", "thinking"):
            blocks.append({"type": kind, "text": block.get(kind, "")})
        elif kind == "tool_use":
            blocks.append(
                {
                    "type": "tool_use",
                    "name": block.get("name", ""),
                    "id": block.get("toolCallId", ""),
                    "input": json.dumps(block.get("input", {}), indent=2, ensure_ascii=False),
                }
            )
        elif kind == "image":
            url = str(block.get("url", ""))
            blocks.append({"type": "image", "text": url if url.startswith("http") else url.split(",", 1)[0] + ",…"})
        else:
            blocks.append({"type": "other", "text": json.dumps(block, ensure_ascii=False)})
    return blocks


def conversation(session: Session) -> list[dict]:
    """The session's full history grouped by the turn that added it (seeded messages first)."""
    turns = {turn.id: turn for turn in session.turns.all()}
    groups: list[dict] = []
    for message in Message.objects.filter(session=session, kind=Message.FULL).order_by("seq"):
        if not groups or groups[-1]["turn_id"] != message.turn_id:
            turn = turns.get(message.turn_id) if message.turn_id is not None else None
            groups.append({"turn_id": message.turn_id, "turn": turn, "messages": []})
        try:
            data = json.loads(message.data)
        except ValueError:
            data = {"role": message.role, "content": message.data}
        groups[-1]["messages"].append(
            {
                "seq": message.seq,
                "role": data.get("role", message.role),
                "tool_call_id": data.get("toolCallId", ""),
                "blocks": _blocks(data.get("content", "")),
            }
        )
    return groups


@admin.register(Session)
class SessionAdmin(admin.ModelAdmin):
    list_display = ("public_id", "tenant", "agent", "created_at", "llm_usage")
    list_filter = ("agent", "tenant")
    search_fields = ("public_id",)
    readonly_fields = (
        "public_id",
        "tenant",
        "agent",
        "redacted_options",
        "server_tools",
        "client_tools",
        "pending_calls",
        "active_turn",
        "llm_usage",
        "created_at",
        "conversation",
    )
    fieldsets = (
        (None, {"fields": ("public_id", "tenant", "agent", "created_at", "active_turn", "llm_usage")}),
        ("Conversation", {"fields": ("conversation",)}),
        (
            "Settings of the session",
            {"classes": ("collapse",), "fields": ("redacted_options", "server_tools", "client_tools", "pending_calls")},
        ),
    )
    inlines = [TurnInline]

    @admin.display(description="options")
    def redacted_options(self, obj):
        from .api.services.validation import redacted_options

        return redacted_options(obj.agent, obj.options)

    @admin.display(description="LLM usage (tokens)")
    def llm_usage(self, obj):
        return _llm_usage(obj)

    @admin.display(description="messages, tool calls and turns")
    def conversation(self, obj):
        if not obj.pk:
            return "-"
        return render_to_string("admin/sessions_app/conversation.html", {"groups": conversation(obj)})

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False  # a session is read here; tenants change it through the API


@admin.register(Turn)
class TurnAdmin(admin.ModelAdmin):
    list_display = ("id", "session", "status", "stream", "stop_reason", "llm_usage", "created_at")
    list_filter = ("status", "stop_reason")
    search_fields = ("id", "session__public_id")
    exclude = ("permissions", "prompt_tokens", "completion_tokens")
    readonly_fields = (
        "id",
        "session",
        "status",
        "stream",
        "stop_reason",
        "cancelled",
        "error",
        "llm_usage",
        "model_calls",
        "created_at",
        "started_at",
        "finished_at",
    )

    @admin.display(description="LLM usage (tokens)")
    def llm_usage(self, obj):
        return _llm_usage(obj)

    def has_add_permission(self, request):
        return False
