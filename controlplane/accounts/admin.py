"""The admin site for teams, members and API tokens. Its writes go through the
accounts actions, as the API's and the dashboard's do, so they are audited as done
by the signed-in operator and keep the same rules: a token's scopes within its
user's role, its secret shown once (a message after adding it) and only its hash
stored; a member removed loses their team tokens; a team keeps an admin. Tokens
are revoked (an action on the list), never deleted: the audit log refers to
them."""

from django import forms
from django.contrib import admin, messages

from controlplane.accounts.actions import (
    check_create_api_token,
    check_create_team,
    check_keeps_an_admin,
    check_manage_team,
    check_source_roots,
    do_add_member,
    do_create_api_token,
    do_create_team,
    do_remove_member,
    do_revoke_api_token,
    do_set_team_source_roots,
)
from controlplane.accounts.models import API_SCOPES, ApiToken, Membership, Team
from controlplane.errors import ControlPlaneError, ValidationFailed


def form_error(form: forms.BaseForm, exc: ControlPlaneError) -> None:
    """Show an action's refusal on the form, on its field when the form has it."""
    form.add_error(exc.field if exc.field in form.fields else None, exc.message)


def saved_as(obj, saved) -> None:
    """Make the admin's unsaved `obj` the row an action saved (the admin logs and
    links to `obj` after save_model)."""
    for field in saved._meta.concrete_fields:
        setattr(obj, field.attname, getattr(saved, field.attname))
    obj._state.adding = False


class OperatorFormMixin:
    """get_form() hands the form the signed-in operator as `actor`: a new form class
    per request (modelform_factory makes one each time), so nothing is shared."""

    def get_form(self, request, obj=None, **kwargs):
        form = super().get_form(request, obj, **kwargs)
        return type(form.__name__, (form,), {"actor": request.user})


class TeamForm(forms.ModelForm):
    actor = None

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

    def clean(self):
        data = super().clean()
        if self.instance.pk is None:
            try:
                check_create_team(self.actor)
            except ControlPlaneError as exc:
                form_error(self, exc)
        return data


class MembershipFormSet(forms.BaseInlineFormSet):
    """The members of a team as the admin edits them: by the team's admins or a
    superuser, and the team keeps an admin."""

    def clean(self):
        super().clean()
        kept = [
            form.cleaned_data
            for form in self.forms
            if form.cleaned_data and not form.cleaned_data.get("DELETE")
        ]
        changed = any(form.has_changed() for form in self.forms)
        if not changed:
            return
        if self.instance.pk is not None:
            try:
                check_manage_team(self.actor, self.instance)
            except ControlPlaneError as exc:
                raise forms.ValidationError(exc.message) from exc
        elif not self.actor.is_superuser:
            raise forms.ValidationError(
                "add the team first; then its admins (or a superuser) add members"
            )
        if kept and not any(data.get("role") == "admin" for data in kept):
            raise forms.ValidationError("a team needs at least one admin")


class MembershipInline(admin.TabularInline):
    model = Membership
    formset = MembershipFormSet
    extra = 0

    def get_formset(self, request, obj=None, **kwargs):
        formset = super().get_formset(request, obj, **kwargs)
        return type(formset.__name__, (formset,), {"actor": request.user})


@admin.register(Team)
class TeamAdmin(OperatorFormMixin, admin.ModelAdmin):
    form = TeamForm
    list_display = ("name", "slug", "created")
    search_fields = ("name", "slug")
    inlines = [MembershipInline]

    def save_model(self, request, obj, form, change):
        roots = form.cleaned_data.get("source_roots") or []
        if not change:
            team = do_create_team(obj.name, slug=obj.slug, actor=request.user)
            if roots:
                team = do_set_team_source_roots(team, roots, actor=request.user)
            saved_as(obj, team)
            return
        if "source_roots" in form.changed_data:
            do_set_team_source_roots(obj, roots, actor=request.user)
        obj.save(update_fields=["name", "slug"])

    def save_formset(self, request, form, formset, change):
        if formset.model is not Membership:
            return super().save_formset(request, form, formset, change)
        memberships = formset.save(commit=False)
        for membership in formset.deleted_objects:
            do_remove_member(membership.team, membership.user, actor=request.user)
        for membership in memberships:
            saved = do_add_member(
                membership.team, membership.user, membership.role, actor=request.user
            )
            saved_as(membership, saved)


class MembershipForm(forms.ModelForm):
    actor = None

    class Meta:
        model = Membership
        fields = ["team", "user", "role"]

    def clean(self):
        data = super().clean()
        team = data.get("team") or getattr(self.instance, "team", None)
        if team is None:
            return data
        try:
            check_manage_team(self.actor, team)
            if self.instance.pk is not None and "role" in data:
                check_keeps_an_admin(self.instance, data["role"])
        except ControlPlaneError as exc:
            form_error(self, exc)
        return data


@admin.register(Membership)
class MembershipAdmin(OperatorFormMixin, admin.ModelAdmin):
    form = MembershipForm
    list_display = ("team", "user", "role")
    list_filter = ("role", "team")

    def get_readonly_fields(self, request, obj=None):
        return ("team", "user") if obj is not None else ()

    def get_actions(self, request):
        # One at a time, through do_remove_member (it revokes the member's tokens
        # and keeps an admin), never the bulk delete.
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def has_delete_permission(self, request, obj=None):
        if obj is not None:
            try:
                check_manage_team(request.user, obj.team)
                check_keeps_an_admin(obj, None)
            except ControlPlaneError:
                return False
        return super().has_delete_permission(request, obj)

    def save_model(self, request, obj, form, change):
        saved = do_add_member(obj.team, obj.user, obj.role, actor=request.user)
        saved_as(obj, saved)

    def delete_model(self, request, obj):
        do_remove_member(obj.team, obj.user, actor=request.user)


class ApiTokenAddForm(forms.ModelForm):
    """A new token: the secret is generated by do_create_api_token, never typed."""

    actor = None
    scopes = forms.MultipleChoiceField(
        choices=[(scope, scope) for scope in API_SCOPES],
        widget=forms.CheckboxSelectMultiple,
        help_text="Only what the client needs; each allowed by the user's role.",
    )

    class Meta:
        model = ApiToken
        fields = ["user", "team", "name"]

    def clean(self):
        data = super().clean()
        if self.errors:
            return data
        try:
            check_create_api_token(
                data["user"],
                data["team"],
                data["name"],
                data["scopes"],
                actor=self.actor,
            )
        except ControlPlaneError as exc:
            form_error(self, exc)
        return data


@admin.register(ApiToken)
class ApiTokenAdmin(OperatorFormMixin, admin.ModelAdmin):
    list_display = ("name", "prefix", "team", "user", "scopes", "last_used", "revoked")
    list_filter = ("team",)
    actions = ["revoke"]

    def get_form(self, request, obj=None, **kwargs):
        if obj is None:
            kwargs["form"] = ApiTokenAddForm
        return super().get_form(request, obj, **kwargs)

    def get_fields(self, request, obj=None):
        if obj is None:
            return ["user", "team", "name", "scopes"]
        return self.get_readonly_fields(request, obj)

    def get_readonly_fields(self, request, obj=None):
        # A token is never edited: the hash and scopes are what was made.
        if obj is None:
            return ()
        return [f.name for f in ApiToken._meta.concrete_fields if f.name != "id"]

    def save_model(self, request, obj, form, change):
        if change:
            return  # nothing is editable
        data = form.cleaned_data
        token, plaintext = do_create_api_token(
            data["user"], data["team"], data["name"], data["scopes"], actor=request.user
        )
        saved_as(obj, token)
        messages.warning(
            request,
            f"The secret of token {token.name!r}, shown this once (only its hash is "
            f"stored); copy it now: {plaintext}",
        )

    def has_delete_permission(self, request, obj=None):
        return False

    @admin.action(description="Revoke selected tokens", permissions=["change"])
    def revoke(self, request, queryset):
        revoked = 0
        for token in queryset.select_related("team", "user"):
            try:
                do_revoke_api_token(token, actor=request.user)
            except ControlPlaneError as exc:
                self.message_user(request, f"{token}: {exc.message}", messages.ERROR)
            else:
                revoked += 1
        self.message_user(request, f"Revoked {revoked} token(s).", messages.SUCCESS)
