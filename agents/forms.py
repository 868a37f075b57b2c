"""Admin forms of the agent registry.

- Options get the inputs of their type: choices (one per line) only for select, a plain
  default for text and select, a masked input for a secret's default that is never rendered
  back (not after a save, not after a validation error).
- JSON fields explain themselves: a parse error says where, and the runtime configuration
  shows an example and the JSON Schema of each runtime kind.
- An `openai` agent cannot be saved without a model to call.
"""

from __future__ import annotations

import json

from django import forms
from django.core.exceptions import ValidationError
from django.utils.datastructures import MultiValueDict
from django.utils.html import format_html, format_html_join

from infra import crypto

from .models import Agent, AgentOption, ServerTool
from .runtimes import RUNTIME_KINDS, runtime_class
from .validation import mcp_option_error, model_source_error

# Shown beside the runtime configuration: a working starting point per kind.
CONFIG_EXAMPLES = {
    "echo": {"window": 20},
    "openai": {
        "model": "gpt-4o-mini",
        "baseUrl": "https://api.openai.com/v1",
        "systemPrompt": "You are a helpful assistant.",
        "timeoutSeconds": 120,
    },
    "acp": {
        "command": ["agentao", "--acp"],
        "env": {"LLM_PROVIDER": "openai"},
        "options": {"model": {"env": "OPENAI_MODEL"}},
        "gateway": {
            "baseUrl": "https://api.openai.com/v1",
            "keyOption": "apiKey",
            "env": {"baseUrl": "OPENAI_BASE_URL", "apiKey": "OPENAI_API_KEY"},
        },
    },
}
TOOL_PARAMETERS_EXAMPLE = {
    "type": "object",
    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    "required": ["a", "b"],
}
MONOSPACE = {"rows": 6, "cols": 80, "style": "font-family: monospace", "spellcheck": "false"}


def _compact(value) -> str:
    return json.dumps(value, separators=(", ", ": "))


class ExplainedJSONField(forms.JSONField):
    """A JSON field whose parse error says where the JSON breaks and shows an example."""

    def __init__(self, *args, example=None, **kwargs):
        self.example = example
        kwargs.setdefault("widget", forms.Textarea(attrs=MONOSPACE))
        super().__init__(*args, **kwargs)

    def to_python(self, value):
        if self.disabled or value in self.empty_values:
            return super().to_python(value)
        try:
            json.loads(value)
        except json.JSONDecodeError as exc:
            hint = f" Example: {_compact(self.example)}" if self.example is not None else ""
            raise ValidationError(
                f"This is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                f"use double quotes around names and strings.{hint}",
                code="invalid",
            ) from None
        return super().to_python(value)


def runtime_config_help() -> str:
    """HTML help for the runtime configuration: per kind, an example and its JSON Schema."""
    rows = []
    for kind in RUNTIME_KINDS:
        try:
            schema = runtime_class(kind).config_schema
        except ImportError:  # an optional runtime whose SDK is missing still gets its example
            schema = {}
        rows.append((kind, _compact(CONFIG_EXAMPLES.get(kind, {})), json.dumps(schema, indent=2)))
    items = format_html_join(
        "",
        '<details class="runtime-help" data-kind="{}"><summary><b>{}</b> — example: <code>{}</code></summary>'
        '<pre style="max-height: 20em; overflow: auto">{}</pre></details>',
        ((kind, kind, example, schema) for kind, example, schema in rows),
    )
    return format_html(
        "A JSON object, validated against the schema of the runtime kind. "
        'An <b>openai</b> agent needs a model: <code>"model"</code> here or an option named <i>model</i>.'
        "{}",
        items,
    )


class AgentForm(forms.ModelForm):
    runtime_config = ExplainedJSONField(required=False, example=CONFIG_EXAMPLES["echo"])

    class Meta:
        model = Agent
        fields = "__all__"  # noqa: DJ007 (the operator's admin form edits every field of an agent)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["runtime_config"].help_text = runtime_config_help()

    def clean_runtime_config(self):
        value = self.cleaned_data.get("runtime_config")
        return {} if value is None else value


class AgentOptionForm(forms.ModelForm):
    """One option, with the inputs its type needs (the admin's script hides the others)."""

    choices = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 30}),
        help_text="Select only: the allowed values, one per line.",
    )
    default = forms.CharField(
        required=False,
        widget=forms.TextInput(attrs={"size": 40}),
        help_text="Text and select: the value used when the application sets none (select: one of the choices).",
    )
    secret_value = forms.CharField(
        required=False,
        label="secret default",
        strip=False,
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "new-password", "size": 40}),
        help_text="Secret only: stored encrypted and never shown again; leave blank to keep the stored one. "
        "After a validation error, type it again.",
    )
    clear_secret = forms.BooleanField(required=False, label="clear the stored secret")

    class Meta:
        model = AgentOption
        fields = ("name", "type", "title", "description", "choices", "default", "position")
        widgets = {"description": forms.Textarea(attrs={"rows": 2, "cols": 30})}

    class Media:
        js = ("agents/admin/option_types.js",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["type"].widget.attrs["data-option-type"] = "1"
        instance = self.instance
        if instance.pk:
            self.initial["choices"] = "\n".join(instance.choices or [])
            if instance.is_secret:
                self.initial["default"] = ""
                if instance.default:
                    self.fields["secret_value"].widget.attrs["placeholder"] = "*** stored — leave blank to keep"
        if not (instance.pk and instance.is_secret and instance.default):
            self.fields["secret_value"].widget.attrs.setdefault("placeholder", "no secret stored")

    def clean_choices(self):
        text = self.cleaned_data.get("choices") or ""
        if self.data.get(self.add_prefix("type")) != AgentOption.SELECT:
            return []  # hidden for other types: whatever it held is dropped, not an error
        return [line.strip() for line in text.splitlines() if line.strip()]

    def clean(self):
        data = super().clean()
        if data is None:  # Django's ModelForm returns its cleaned_data; the stubs allow None
            data = self.cleaned_data
        if data.get("type") == AgentOption.SECRET:
            # A secret never round-trips through the form: keep, replace or clear it. Typed
            # into the plain default field (no script), it is still taken as the secret.
            entered = data.get("secret_value") or data.get("default") or ""
            previous = self.instance.default if self.instance.pk and self.instance.is_secret else ""
            if data.get("clear_secret"):
                data["default"] = ""
            elif entered in ("", crypto.REDACTED):
                data["default"] = previous
            else:
                data["default"] = crypto.encrypt(entered)
        return data

    def full_clean(self):
        super().full_clean()
        if self.is_bound and self.data.get(self.add_prefix("type")) == AgentOption.SECRET:
            # Whatever was typed for a secret is never rendered back, even if the form has errors.
            # A request's QueryDict is immutable and its copy is not; a plain mapping is copied.
            data = self.data.copy() if isinstance(self.data, MultiValueDict) else dict(self.data)
            for name in ("default", "secret_value"):
                data[self.add_prefix(name)] = ""
            self.data = data


class AgentOptionFormSet(forms.BaseInlineFormSet):
    """The options of one agent, checked together with the agent's runtime."""

    def clean(self):
        super().clean()
        options = [
            {"name": form.cleaned_data.get("name")}
            for form in self.forms
            if getattr(form, "cleaned_data", None) and not form.cleaned_data.get("DELETE")
        ]
        error = model_source_error(
            self.instance.runtime_kind, self.instance.runtime_config, options
        ) or mcp_option_error(self.instance.runtime_config, options)
        if error:
            raise ValidationError(error)


class ServerToolForm(forms.ModelForm):
    parameters = ExplainedJSONField(
        required=False,
        example=TOOL_PARAMETERS_EXAMPLE,
        help_text=format_html(
            "A JSON Schema of the arguments; empty: the implementation's own. Example: <code>{}</code>",
            _compact(TOOL_PARAMETERS_EXAMPLE),
        ),
    )
    settings = ExplainedJSONField(
        required=False,
        example={"maxChars": 20000, "timeoutSeconds": 10},
        help_text="A JSON object of settings for the host implementation; usually {}.",
    )

    class Meta:
        model = ServerTool
        fields = ("name", "title", "description", "implementation", "parameters", "settings", "enabled", "position")
        widgets = {"description": forms.Textarea(attrs={"rows": 2, "cols": 60})}

    def clean_parameters(self):
        value = self.cleaned_data.get("parameters")
        return {} if value is None else value

    def clean_settings(self):
        value = self.cleaned_data.get("settings")
        return {} if value is None else value
