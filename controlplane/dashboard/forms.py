"""Filter forms of the list pages. Choices come from what the user may see, so a
value outside them (another team's model, a state that doesn't exist) is a form
error shown on the page, never a filter silently dropped."""

from django import forms

from controlplane.dashboard import access
from controlplane.releases.models import RELEASE_STATES


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
