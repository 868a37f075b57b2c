from django.contrib import admin

from .models import Session, Turn


class TurnInline(admin.TabularInline):
    model = Turn
    extra = 0
    fields = ("id", "status", "stream", "stop_reason", "cancelled", "error", "prompt_tokens", "completion_tokens", "created_at", "finished_at")
    readonly_fields = fields
    can_delete = False
    ordering = ("-created_at",)

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Session)
class SessionAdmin(admin.ModelAdmin):
    list_display = ("public_id", "tenant", "agent", "created_at", "prompt_tokens", "completion_tokens")
    list_filter = ("agent", "tenant")
    search_fields = ("public_id",)
    readonly_fields = ("public_id", "tenant", "agent", "redacted_options", "server_tools", "client_tools",
                       "pending_calls", "active_turn", "prompt_tokens", "completion_tokens", "created_at")
    exclude = ("options", "message_seq")
    inlines = [TurnInline]

    @admin.display(description="options")
    def redacted_options(self, obj):
        from .services import redacted_options

        return redacted_options(obj.agent, obj.options)

    def has_add_permission(self, request):
        return False


@admin.register(Turn)
class TurnAdmin(admin.ModelAdmin):
    list_display = ("id", "session", "status", "stream", "stop_reason", "prompt_tokens", "completion_tokens", "created_at")
    list_filter = ("status", "stop_reason")
    search_fields = ("id", "session__public_id")
    exclude = ("permissions",)
    readonly_fields = ("id", "session", "status", "stream", "stop_reason", "cancelled", "error", "prompt_tokens",
                       "completion_tokens", "model_calls", "created_at", "started_at", "finished_at")

    def has_add_permission(self, request):
        return False
