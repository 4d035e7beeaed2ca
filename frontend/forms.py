from django import forms
from django.contrib.auth.password_validation import validate_password
from django.utils import timezone

from accounts.models import User
from accounts.roles import Role


class ApiTokenForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="What the token is for, e.g. 'grafana' or 'ci'.")
    expires_at = forms.DateTimeField(
        required=False, widget=forms.DateTimeInput(attrs={"type": "datetime-local"}), help_text="Optional."
    )

    def clean_expires_at(self):
        value = self.cleaned_data["expires_at"]
        if value is not None and value <= timezone.now():
            raise forms.ValidationError("The expiry must be in the future.")
        return value


class UserCreateForm(forms.Form):
    username = forms.RegexField(r"^[\w.@+-]{1,150}$", max_length=150)
    email = forms.EmailField(required=False)
    role = forms.ChoiceField(choices=Role.choices)
    password = forms.CharField(widget=forms.PasswordInput, min_length=10)

    def clean_username(self):
        username = self.cleaned_data["username"]
        if User.objects.filter(username=username).exists():
            raise forms.ValidationError("A user with this username exists.")
        return username

    def clean(self):
        data = super().clean()
        if data.get("password") and data.get("username"):
            validate_password(data["password"], User(username=data["username"], email=data.get("email", "")))
        return data
