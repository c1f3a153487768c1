from django import forms
from django.contrib import admin

from controlplane.accounts.actions import check_source_roots
from controlplane.accounts.models import ApiToken, Membership, Team
from controlplane.errors import ValidationFailed


class TeamForm(forms.ModelForm):
    class Meta:
        model = Team
        fields = ["name", "slug", "source_roots"]
        help_texts = {
            "source_roots": 'A JSON list of absolute folders, e.g. ["/srv/models/'
            'acme"], each inside RELEASEGATE_SOURCE_ROOTS; [] for <root>/<slug>.'
        }

    def clean_source_roots(self):
        roots = self.cleaned_data["source_roots"] or []
        if not isinstance(roots, list):
            raise forms.ValidationError("a JSON list of absolute paths")
        try:
            return check_source_roots(roots)
        except ValidationFailed as exc:
            raise forms.ValidationError(exc.message) from exc


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    form = TeamForm
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
