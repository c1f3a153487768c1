"""Filter forms of the list pages. Choices come from what the user may see, so a
value outside them (another team's model, a state that doesn't exist) is a form
error shown on the page, never a filter silently dropped."""

from django import forms

from controlplane.accounts.actions import TOKEN_NAME_MAX_LENGTH
from controlplane.accounts.models import API_SCOPES, ROLE_SCOPES, Membership
from controlplane.costs.report import parse_targets
from controlplane.dashboard import access
from controlplane.releases.models import RELEASE_STATES
from gpuagent.integrity.strict_json import Rejected, strict_json_loads
from gpuagent.sizing import KEEP_BF16_CLASSES, KV_DTYPES, Knobs

# What each scope lets a token do (as the README's table says).
SCOPE_LABELS = {
    "read": "read: list and read releases, environments, deployments, the audit log",
    "register": "register: create model families, register releases",
    "promote": "promote: promote, reopen, roll back",
    "approve": "approve: approve or reject releases (approver or admin role)",
    "admin": "admin: gate policies, cost models, webhooks, members, environments, "
    "tokens (admin role)",
}


# The weight formats the sizing page offers (gpuagent.sizing.weight_format takes them).
SIZING_WEIGHT_FORMATS = (
    "bf16",
    "fp8",
    "w8a16",
    "w4a16-g128",
    "w4a16-g64",
    "w4a16-g32",
    "w4a16-g128-asym",
)


def _blank(label: str) -> list[tuple[str, str]]:
    return [("", label)]


class ReleaseFilterForm(forms.Form):
    model = forms.ChoiceField(required=False)
    environment = forms.ChoiceField(required=False)
    state = forms.ChoiceField(
        required=False, choices=_blank("any state") + [(s, s) for s in RELEASE_STATES]
    )

    def __init__(self, user, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["model"].choices = _blank("any model") + [
            (str(f.pk), f"{f.team.slug}/{f.name}") for f in access.model_families(user)
        ]
        self.fields["environment"].choices = _blank("any environment") + [
            (str(e.pk), str(e)) for e in access.environments(user)
        ]

    def apply(self, releases):
        data = self.cleaned_data
        if data.get("model"):
            releases = releases.filter(model_id=int(data["model"]))
        if data.get("environment"):
            releases = releases.filter(target_environment_id=int(data["environment"]))
        if data.get("state"):
            releases = releases.filter(state=data["state"])
        return releases


def filter_releases(request):
    """(form, the user's releases as filtered by the query string, HTTP status): a
    filter that doesn't validate shows its errors with no rows and a 400."""
    form = ReleaseFilterForm(request.user, request.GET or None)
    releases = access.releases(request.user)
    if not form.is_bound:
        return form, releases, 200
    if not form.is_valid():
        return form, releases.none(), 400
    return form, form.apply(releases), 200


class AuditFilterForm(forms.Form):
    team = forms.ChoiceField(required=False)
    verb = forms.CharField(required=False, max_length=100)
    object_type = forms.ChoiceField(required=False)
    actor = forms.CharField(required=False, max_length=200)
    since = forms.DateTimeField(
        required=False,
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
        help_text="UTC",
    )
    until = forms.DateTimeField(
        required=False,
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
        help_text="UTC",
    )

    def __init__(self, user, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["team"].choices = _blank("any team") + [
            (str(t.pk), t.slug) for t in access.teams(user)
        ]
        object_types = (
            access.audit_events(user)
            .order_by()
            .values_list("object_type", flat=True)
            .distinct()
        )
        self.fields["object_type"].choices = _blank("any object") + [
            (t, t) for t in sorted(object_types)
        ]

    def clean(self):
        data = super().clean()
        since, until = data.get("since"), data.get("until")
        if since and until and since >= until:
            raise forms.ValidationError("'since' must be before 'until'")
        return data

    def apply(self, events):
        data = self.cleaned_data
        if data.get("team"):
            events = events.filter(team_id=int(data["team"]))
        if data.get("verb"):
            events = events.filter(verb__icontains=data["verb"])
        if data.get("object_type"):
            events = events.filter(object_type=data["object_type"])
        if data.get("actor"):
            events = events.filter(actor_name__icontains=data["actor"])
        if data.get("since"):
            events = events.filter(created__gte=data["since"])
        if data.get("until"):
            events = events.filter(created__lt=data["until"])
        return events


class ApiTokenForm(forms.Form):
    """A new API token of the signed-in user: in one of their teams, with scopes
    their role there allows (least privilege: read is the one ticked at first)."""

    team = forms.ChoiceField()
    name = forms.CharField(
        max_length=TOKEN_NAME_MAX_LENGTH, help_text="what it is for, e.g. ci-main"
    )
    scopes = forms.MultipleChoiceField(
        choices=[(scope, SCOPE_LABELS[scope]) for scope in API_SCOPES],
        widget=forms.CheckboxSelectMultiple,
        initial=["read"],
    )

    def __init__(self, user, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.memberships = {
            str(m.team_id): m
            for m in Membership.objects.filter(user=user).select_related("team")
        }
        self.fields["team"].choices = [
            (pk, m.team.slug) for pk, m in self.memberships.items()
        ]

    def allowed_scopes(self) -> list[tuple[str, str, tuple[str, ...]]]:
        """(team slug, role, scopes the role allows) for each of the user's teams."""
        return [
            (m.team.slug, m.role, ROLE_SCOPES[m.role])
            for m in self.memberships.values()
        ]

    def clean(self):
        data = super().clean()
        membership = self.memberships.get(data.get("team", ""))
        if membership is None:
            return data
        data["team"] = membership.team
        allowed = ROLE_SCOPES[membership.role]
        beyond = [s for s in data.get("scopes", ()) if s not in allowed]
        if beyond:
            self.add_error(
                "scopes",
                f"not allowed for your role in {membership.team.slug} "
                f"({membership.role}): {', '.join(beyond)}; it allows "
                f"{', '.join(allowed)}",
            )
        return data


def typed_targets(request) -> tuple[dict[str, float] | None, str]:
    """(the target traffic typed on a page, `?targets=chat:20,rag:5`, or None for
    each environment's own; why it could not be read, or "")."""
    text = request.GET.get("targets")
    if text is None:
        return None, ""
    try:
        return parse_targets(text), ""
    except ValueError as exc:
        return None, f"targets: {exc}"


class SizingForm(forms.Form):
    """A pasted config.json and the deployment's knobs (gpuagent.sizing.Knobs)."""

    config = forms.CharField(
        label="config.json",
        widget=forms.Textarea(attrs={"rows": 14, "spellcheck": "false"}),
        max_length=1_000_000,
        help_text="the model's config.json as published",
    )
    gpu_memory_gib = forms.FloatField(
        label="GPU memory (GiB)", min_value=1, max_value=4096, initial=80
    )
    devices = forms.IntegerField(
        label="Devices", min_value=1, max_value=1024, initial=8
    )
    context_tokens = forms.IntegerField(
        label="Context (tokens)", min_value=1, max_value=2**24, initial=32768
    )
    sessions = forms.IntegerField(
        label="Sessions", min_value=1, max_value=2**20, initial=16
    )
    weights = forms.ChoiceField(
        label="Weights",
        choices=[(f, f) for f in SIZING_WEIGHT_FORMATS],
        initial="w4a16-g128",
    )
    kv_cache_dtype = forms.ChoiceField(
        label="KV cache dtype", choices=[(d, d) for d in KV_DTYPES], initial="fp8"
    )
    gpu_memory_utilization = forms.FloatField(
        label="GPU memory utilization", min_value=0.05, max_value=1, initial=0.9
    )
    activation_headroom_gib = forms.FloatField(
        label="Activation headroom (GiB)", min_value=0, max_value=4096, initial=4
    )
    keep_bf16 = forms.MultipleChoiceField(
        label="Left in bf16",
        choices=[(c, c) for c in KEEP_BF16_CLASSES],
        required=False,
        widget=forms.CheckboxSelectMultiple,
    )
    parallelism = forms.ChoiceField(
        label="Parallelism",
        choices=[
            ("tensor", "tensor: one tensor-parallel group"),
            ("data", "data: data-parallel attention + expert parallel"),
        ],
        initial="tensor",
    )

    def clean_config(self) -> dict:
        try:
            config = strict_json_loads(self.cleaned_data["config"], 32)
        except (Rejected, ValueError) as exc:
            raise forms.ValidationError(f"not valid JSON: {exc}") from None
        if not isinstance(config, dict):
            raise forms.ValidationError("config.json must be a JSON object")
        return config

    def knobs(self) -> Knobs:
        data = {k: v for k, v in self.cleaned_data.items() if k != "config"}
        return Knobs(**{**data, "keep_bf16": tuple(data["keep_bf16"])})
