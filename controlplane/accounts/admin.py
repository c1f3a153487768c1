from django.contrib import admin

from controlplane.accounts.models import ApiToken, Membership, Team


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ("name", "slug", "created")
    search_fields = ("name", "slug")
    inlines = [MembershipInline]


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ("team", "user", "role")
    list_filter = ("role", "team")


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ("name", "prefix", "team", "user", "scopes", "last_used", "revoked")
    list_filter = ("team",)
    # Tokens are created by the management command (which shows the plaintext once);
    # the hash is never editable here.
    readonly_fields = ("prefix", "token_hash", "created", "last_used")

    def has_add_permission(self, request):
        return False
