"""Admin forms: a secret default is write-only."""

from django import forms

from hosting import crypto

from .models import AgentOption


class AgentOptionForm(forms.ModelForm):
    """`default` is plain text for text/select options; for a secret option the field is a
    write-only password input: blank keeps the stored secret, `clear` removes it."""

    clear_secret = forms.BooleanField(required=False, label="clear secret")

    class Meta:
        model = AgentOption
        fields = ("name", "type", "title", "description", "choices", "default", "clear_secret", "position")
        widgets = {"description": forms.Textarea(attrs={"rows": 2, "cols": 30})}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["default"].required = False
        if self.instance and self.instance.pk and self.instance.is_secret:
            self.initial["default"] = ""
            stored = bool(self.instance.default)
            self.fields["default"].widget = forms.PasswordInput(
                render_value=False,
                attrs={"placeholder": "*** stored — leave blank to keep" if stored else "no secret stored"},
            )

    def clean(self):
        data = super().clean()
        # A secret default never round-trips through the form: keep, replace or clear it.
        if data.get("type") == AgentOption.SECRET:
            entered = data.get("default") or ""
            previous = self.instance.default if self.instance.pk and self.instance.is_secret else ""
            if data.get("clear_secret"):
                data["default"] = ""
            elif entered in ("", crypto.REDACTED):
                data["default"] = previous
            else:
                data["default"] = crypto.encrypt(entered)
        return data
