from django.contrib import admin, messages
from django.db.models import Sum
from django.utils import timezone

from .models import LIMIT_FIELDS, ApiToken, Tenant
from .services import token_create

# "View site" leads to the API's interactive documentation: the site of this service is its API.
admin.site.site_url = "/v1/docs"
admin.site.site_header = "aap-hosting administration"
admin.site.site_title = "aap-hosting admin"
admin.site.index_title = "Agents, tenants and sessions"


class ApiTokenInline(admin.TabularInline):
    model = ApiToken
    extra = 0
    fields = ("prefix", "name", "created_at", "last_used_at", "expires_at", "revoked_at")
    readonly_fields = ("prefix", "created_at", "last_used_at")
    show_change_link = True

    def has_add_permission(self, request, obj=None):
        return False  # tokens are added from the token page, where the new token is shown once


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("name", "title", "is_active", "created_at", "prompt_tokens", "completion_tokens")
    search_fields = ("name", "title")
    inlines = [ApiTokenInline]
    fieldsets = [
        (None, {"fields": ("name", "title", "is_active")}),
        (
            "Limits",
            {
                "fields": LIMIT_FIELDS,
                "description": "Empty: the service's default (AAP_TENANT_* settings). 0: no limit. "
                "Over a limit the API answers 429 with Retry-After; nothing is stored.",
            },
        ),
        (
            "Scheduling",
            {
                "fields": ("weight",),
                "description": "When every worker is busy, the next free one takes a waiting turn of the tenant "
                "with the fewest running turns per unit of weight.",
            },
        ),
    ]

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        if change:
            return
        # A new tenant gets its first API token at once (the page's transaction covers both).
        _, raw = token_create(tenant=obj, name="initial")
        messages.warning(
            request,
            f"Tenant {obj.name} can call the API with this token: {raw} — copy it now, "
            "it is not stored and will not be shown again (more tokens: API tokens, Add).",
        )

    def get_queryset(self, request):
        return (
            super()
            .get_queryset(request)
            .annotate(_prompt=Sum("sessions__prompt_tokens"), _completion=Sum("sessions__completion_tokens"))
        )

    @admin.display(description="LLM prompt tokens", ordering="_prompt")
    def prompt_tokens(self, obj):
        return obj._prompt or 0

    @admin.display(description="LLM completion tokens", ordering="_completion")
    def completion_tokens(self, obj):
        return obj._completion or 0


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ("prefix", "tenant", "name", "created_at", "last_used_at", "expires_at", "revoked_at")
    list_filter = ("tenant",)
    search_fields = ("prefix", "name", "tenant__name")
    readonly_fields = ("prefix", "created_at", "last_used_at")
    actions = ["revoke"]

    def get_fields(self, request, obj=None):
        if obj is None:
            return ("tenant", "name", "expires_at")
        return ("tenant", "name", "prefix", "created_at", "last_used_at", "expires_at", "revoked_at")

    def save_model(self, request, obj, form, change):
        if change:
            return super().save_model(request, obj, form, change)
        token, raw = token_create(tenant=obj.tenant, name=obj.name, expires_at=obj.expires_at)
        obj.pk = token.pk
        obj.prefix, obj.token_hash, obj.created_at = token.prefix, token.token_hash, token.created_at
        messages.warning(
            request,
            f"New API token for {token.tenant}: {raw} — copy it now, it is not stored and will not be shown again.",
        )

    @admin.action(description="Revoke the selected tokens")
    def revoke(self, request, queryset):
        count = queryset.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
        self.message_user(request, f"Revoked {count} token(s).")
