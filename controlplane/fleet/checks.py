"""Deploy-time checks of agent identity settings (`manage.py check --deploy`)."""

import os

from django.conf import settings
from django.core.checks import Tags, Warning, register


@register(Tags.security, deploy=True)
def check_agent_identity_settings(app_configs=None, **kwargs) -> list[Warning]:
    warnings = []
    if not os.environ.get("RELEASEGATE_CONTROLPLANE_KEY"):
        path = settings.RELEASEGATE_CONTROLPLANE_KEY
        warnings.append(
            Warning(
                "RELEASEGATE_CONTROLPLANE_KEY is not set: job requests are sealed "
                f"with a key made on first use at {path}",
                hint="point it at a key file kept off the repository and give "
                "agents its public half (--controlplane-key)",
                id="fleet.W001",
            )
        )
    if settings.RELEASEGATE_ALLOW_VERIFY_ON_SIGNER:
        warnings.append(
            Warning(
                "RELEASEGATE_ALLOW_VERIFY_ON_SIGNER is on: the agent that signed a "
                "release may verify it (no second look)",
                hint="leave it off outside the one-agent demo",
                id="fleet.W002",
            )
        )
    return warnings
