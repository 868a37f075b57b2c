from django.contrib import admin, messages
from django.db import transaction

from . import mcp_registry as registry
from .forms import AgentForm, AgentOptionForm, AgentOptionFormSet, ServerToolForm
from .models import Agent, AgentOption, ServerTool
from .selectors import server_tool_specs
from .services import mcp_refresh


class AgentOptionInline(admin.StackedInline):
    model = AgentOption
    form = AgentOptionForm
    formset = AgentOptionFormSet
    extra = 0
    fields = ("name", "type", "title", "description", "choices", "default", "secret_value", "clear_secret", "position")


class ServerToolInline(admin.StackedInline):
    model = ServerTool
    form = ServerToolForm
    extra = 0
    fields = ("name", "title", "description", "implementation", "parameters", "settings", "enabled", "position")


@admin.register(Agent)
class AgentAdmin(admin.ModelAdmin):
    form = AgentForm
    list_display = ("name", "title", "version", "runtime_kind", "enabled", "tenant_list")
    list_filter = ("runtime_kind", "enabled")
    search_fields = ("name", "title", "description")
    filter_horizontal = ("tenants",)
    inlines = [AgentOptionInline, ServerToolInline]
    readonly_fields = ("capabilities_preview", "created_at", "updated_at")
    fieldsets = (
        (None, {"fields": ("name", "title", "version", "description", "enabled")}),
        ("Runtime", {"fields": ("runtime_kind", "runtime_config")}),
        (
            "Capabilities",
            {
                "fields": (
                    ("client_tools", "image_http", "image_data"),
                    ("history_full", "history_compacted"),
                    ("stream_delta", "stream_message", "stream_none"),
                    "capabilities_preview",
                )
            },
        ),
        ("Access", {"fields": ("tenants",)}),
        (None, {"fields": ("created_at", "updated_at")}),
    )

    def save_related(self, request, form, formsets, change):
        super().save_related(request, form, formsets, change)
        agent = form.instance
        if registry.hosts_mcp_servers(agent):
            # Listed once the change is committed: the MCP servers' tools as of this revision.
            transaction.on_commit(lambda: self._list_mcp_tools(request, agent.name))

    def _list_mcp_tools(self, request, name: str) -> None:
        for line in mcp_refresh(name):
            told = line.endswith((" tools", " is being listed by a worker."))
            self.message_user(request, line, messages.INFO if told else messages.WARNING)

    @admin.display(description="tenants")
    def tenant_list(self, obj):
        names = [t.name for t in obj.tenants.all()]
        return ", ".join(names) if names else "all"

    @admin.display(description="capabilities in /meta")
    def capabilities_preview(self, obj):
        if not obj.pk:
            return "-"
        tools = ", ".join(spec["name"] for spec in server_tool_specs(obj)) or "none"
        return f"{obj.capabilities()} — server tools: {tools}"
