from django.db import models

from gpuagent.protocol import LoadPlan


class EnvironmentLoadPlan(models.Model):
    """The load-test plan of one environment, as gpuagent.protocol.LoadPlan's JSON
    (validated by the action that writes it). An environment without a row runs
    the default plan (`default_load_plan()`)."""

    environment = models.OneToOneField(
        "fleet.Environment", models.CASCADE, related_name="load_plan"
    )
    spec_json = models.JSONField(default=dict)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "environment load plan"

    def __str__(self) -> str:
        return f"load plan of {self.environment}"

    @property
    def spec(self) -> LoadPlan:
        return LoadPlan.model_validate(self.spec_json)
