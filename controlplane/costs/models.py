from django.db import models

from controlplane.costs.spec import CostModel


class EnvironmentCostModel(models.Model):
    """The cost model of one environment, as costs.spec.CostModel's JSON (validated
    by the action that writes it). An environment without a row uses the default
    CostModel(): a device-hour at 0 USD, which prices nothing."""

    environment = models.OneToOneField(
        "fleet.Environment", models.CASCADE, related_name="cost_model"
    )
    spec_json = models.JSONField(default=dict)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "environment cost model"

    def __str__(self) -> str:
        return f"cost model of {self.environment}"

    @property
    def spec(self) -> CostModel:
        return CostModel.model_validate(self.spec_json)
