from django.contrib import admin
from django.contrib.auth.admin import UserAdmin

from accounts.models import ApiToken, User


@admin.register(User)
class OperatorAdmin(UserAdmin):
    list_display = ("username", "email", "role", "is_active", "last_login")
    list_filter = ("role", "is_active")
    fieldsets = UserAdmin.fieldsets + (("Fleet role", {"fields": ("role",)}),)


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ("name", "prefix", "user", "created_at", "expires_at", "last_used_at", "revoked_at")
    readonly_fields = ("prefix", "token_hash", "last_used_at")
