from django import forms
from django.contrib import admin

from controlplane.accounts.actions import check_manage_team
from controlplane.accounts.admin import OperatorFormMixin, form_error, saved_as
from controlplane.costs.actions import check_cost_model, do_set_cost_model
from controlplane.costs.models import EnvironmentCostModel
from controlplane.errors import ControlPlaneError


class EnvironmentCostModelForm(forms.ModelForm):
    actor = None

    class Meta:
        model = EnvironmentCostModel
        fields = ["environment", "spec_json"]
        labels = {"spec_json": "Cost model"}
        help_texts = {
            "spec_json": "JSON of costs.spec.CostModel (README: Cost and capacity), "
            'e.g. {"currency": "KRW", "device_hourly_price": "4500", '
            '"power_draw_w": "700", "electricity_price_per_kwh": "120.5", '
            '"devices_per_replica": 1, "target_requests_per_s": {"chat": 20}, '
            '"note": "list price 2025"}; prices as decimal strings.'
        }

    def clean_spec_json(self):
        try:
            model = check_cost_model(self.cleaned_data["spec_json"], prefix="")
        except ControlPlaneError as exc:
            raise forms.ValidationError(exc.message) from exc
        return model.model_dump(mode="json")

    def clean(self):
        data = super().clean()
        environment = data.get("environment")
        if environment is not None:
            try:
                check_manage_team(self.actor, environment.team)
            except ControlPlaneError as exc:
                form_error(self, exc)
        return data


@admin.register(EnvironmentCostModel)
class EnvironmentCostModelAdmin(OperatorFormMixin, admin.ModelAdmin):
    form = EnvironmentCostModelForm
    list_display = ("environment", "updated")

    def save_model(self, request, obj, form, change):
        # Through the action: checked against the signed-in operator and audited.
        saved = do_set_cost_model(
            obj.environment, obj.spec_json, actor=request.user, prefix=""
        )
        saved_as(obj, saved)
