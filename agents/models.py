"""The agent registry an operator edits in Django admin (or with `apply_agents`)."""

import re
from typing import Any

import jsonschema
from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django.db import models

from infra import crypto

from . import tools as host_tools
from .runtimes import kind_choices, runtime_class

SEMVER_RE = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
TOOL_NAME_RE = r"^[A-Za-z0-9_-]{1,64}$"
tool_name_validator = RegexValidator(TOOL_NAME_RE, "Use 1 to 64 letters, digits, '_' or '-'.")
option_name_validator = RegexValidator(
    r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$", "Start with a letter; use letters, digits, '_', '.', '-'."
)


def validate_semver(value: str) -> None:
    if not SEMVER_RE.match(value or ""):
        raise ValidationError("Use a semantic version such as 1.0.0.")


def validate_json_schema(value) -> None:
    if not isinstance(value, dict):
        raise ValidationError('Parameters must be a JSON Schema object, e.g. {"type": "object"}.')
    try:
        jsonschema.validators.validator_for(value).check_schema(value)
    except jsonschema.SchemaError as exc:
        raise ValidationError(f"Parameters are not a valid JSON Schema: {exc.message}") from None


class AgentQuerySet(models.QuerySet):
    def for_tenant(self, tenant):
        """Enabled agents this tenant may use (an agent with no tenants is open to all)."""
        return self.filter(enabled=True).filter(models.Q(tenants__isnull=True) | models.Q(tenants=tenant)).distinct()


class Agent(models.Model):
    name = models.SlugField(max_length=100, unique=True, help_text="The agent's name in AAP requests.")
    title = models.CharField(max_length=200, blank=True)
    version = models.CharField(max_length=64, default="1.0.0", validators=[validate_semver])
    description = models.TextField(blank=True)
    runtime_kind = models.CharField(max_length=32, choices=kind_choices, default="echo")
    runtime_config = models.JSONField(default=dict, blank=True, help_text="Validated per runtime kind.")
    enabled = models.BooleanField(default=True)
    tenants = models.ManyToManyField(
        "hosting.Tenant", blank=True, related_name="agents", help_text="None selected: every tenant."
    )
    # Capability toggles (narrow what the runtime kind supports).
    client_tools = models.BooleanField("accepts client tools", default=True)
    image_http = models.BooleanField("accepts https:// images", default=False)
    image_data = models.BooleanField("accepts data: images", default=False)
    history_full = models.BooleanField("shows full history", default=True)
    history_compacted = models.BooleanField("shows compacted history", default=True)
    stream_delta = models.BooleanField("streams deltas", default=True)
    stream_message = models.BooleanField("streams messages", default=True)
    stream_none = models.BooleanField("answers without streaming", default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = AgentQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def runtime(self):
        return runtime_class(self.runtime_kind)

    def clean(self):
        try:
            self.runtime_config = runtime_class(self.runtime_kind).validate_config(self.runtime_config)
        except ValueError as exc:
            raise ValidationError({"runtime_config": str(exc)}) from None

    def capabilities(self) -> dict:
        supports = self.runtime.supports
        caps: dict = {
            "history": {name: {} for name in supports.get("history", ()) if getattr(self, f"history_{name}")},
            "stream": {name: {} for name in supports.get("stream", ()) if getattr(self, f"stream_{name}")},
        }
        if supports.get("application_tools") and self.client_tools:
            caps["application"] = {"tools": {}}
        image: dict[str, dict[str, Any]] = {
            kind: {}
            for kind, toggled in (("http", self.image_http), ("data", self.image_data))
            if toggled and kind in supports.get("image", ())
        }
        if image:
            caps["image"] = image
        return {key: value for key, value in caps.items() if value}


class AgentOption(models.Model):
    TEXT, SECRET, SELECT = "text", "secret", "select"
    TYPES = [(TEXT, "text"), (SECRET, "secret"), (SELECT, "select")]

    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="options")
    name = models.CharField(max_length=64, validators=[option_name_validator])
    type = models.CharField(max_length=8, choices=TYPES, default=TEXT)
    title = models.CharField(max_length=200, blank=True)
    description = models.TextField(blank=True)
    choices = models.JSONField(default=list, blank=True, help_text="Select only: the allowed values.")
    # For a secret option this holds Fernet ciphertext, never the plaintext.
    default = models.TextField(blank=True, default="")
    position = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["position", "id"]
        constraints = [models.UniqueConstraint(fields=["agent", "name"], name="unique_option_per_agent")]

    def __str__(self) -> str:
        return f"{self.agent}.{self.name}"

    @property
    def is_secret(self) -> bool:
        return self.type == self.SECRET

    def clean(self):
        if self.type == self.SELECT:
            if (
                not isinstance(self.choices, list)
                or not self.choices
                or not all(isinstance(c, str) for c in self.choices)
            ):
                raise ValidationError({"choices": "A select option needs a list of string choices."})
            if self.default not in self.choices:
                raise ValidationError({"default": "The default must be one of the choices."})
        elif self.choices:
            raise ValidationError({"choices": "Only select options have choices."})

    def set_secret_default(self, plaintext: str) -> None:
        self.default = crypto.encrypt(plaintext) if plaintext else ""

    def default_value(self) -> str:
        """The effective default (decrypted for secrets; in memory only)."""
        return crypto.decrypt(self.default) if self.is_secret else self.default

    def public_default(self) -> str:
        if self.is_secret:
            return crypto.REDACTED if self.default else ""
        return self.default


class ServerTool(models.Model):
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="server_tools")
    name = models.CharField(max_length=64, validators=[tool_name_validator])
    title = models.CharField(max_length=200, blank=True)
    description = models.TextField()
    parameters = models.JSONField(default=dict, blank=True, validators=[validate_json_schema])
    implementation = models.CharField(max_length=64, choices=host_tools.implementation_choices)
    settings = models.JSONField(default=dict, blank=True, help_text="Settings of the host implementation.")
    enabled = models.BooleanField(default=True)
    position = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["position", "id"]
        constraints = [models.UniqueConstraint(fields=["agent", "name"], name="unique_server_tool_per_agent")]

    def __str__(self) -> str:
        return f"{self.agent}.{self.name}"

    def clean(self):
        if not self.parameters:
            impl = host_tools.get(self.implementation)
            self.parameters = dict(impl.parameters) if impl else {"type": "object", "properties": {}}
        validate_json_schema(self.parameters)
        if not isinstance(self.settings, dict):
            raise ValidationError({"settings": "Settings must be a JSON object."})

    def spec(self) -> dict:
        spec: dict[str, Any] = {"name": self.name}
        if self.title:
            spec["title"] = self.title
        spec["description"] = self.description
        spec["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return spec


class McpToolList(models.Model):
    """The tools an agent's MCP servers listed (`tools/list`), as of the agent's revision:
    read by every process (/meta, sessions, turns) instead of asking the servers again.
    Listed again when the agent changes (its `updated_at` moves) or a server says its list
    changed (agents.mcp_registry)."""

    agent = models.OneToOneField(Agent, on_delete=models.CASCADE, primary_key=True, related_name="mcp_tool_list")
    revision = models.DateTimeField(help_text="The agent's updated_at these tools were listed for.")
    # [{name, server, tool, title?, description, parameters}]: name is the server tool's name in AAP.
    tools = models.JSONField(default=list, blank=True)
    # server name -> why it listed nothing (a safe sentence)
    problems = models.JSONField(default=dict, blank=True)
    listed_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"MCP tools of {self.agent_id}"
