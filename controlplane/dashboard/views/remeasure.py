"""Re-measure a judged release (its evaluate and/or load test again, then its gate),
in the two steps of views/outcome.py: the form on the release page posts here with
the stages ticked, the answer is a confirmation page saying what runs again, and
only its "Confirm" post calls pipeline.remeasure, what the API's POST
.../remeasure calls, with the same rule on who may (whoever may promote in the
release's team) and in which states (actions/remeasure.py)."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.views.decorators.http import require_POST

from controlplane.dashboard import access
from controlplane.dashboard.views.outcome import answer, confirmed
from controlplane.releases import pipeline
from controlplane.releases.actions.remeasure import (
    check_remeasure_release,
    check_remeasure_stages,
)

# What each stage measures, as the form and the confirmation page word it.
STAGE_LABELS = {
    "evaluate": "evaluate: the quality report against the parent",
    "load_test": "load test: the environment's load plan in force",
}


@require_POST
@login_required
def remeasure_release(request, release_id: int):
    release = access.release_or_404(request.user, release_id)
    posted = request.POST.getlist("stages")

    def attempt():
        # Who (403), then what was ticked, then the state (a message).
        check_remeasure_release(release, request.user)
        stages = check_remeasure_stages(posted)
        if confirmed(request):
            return pipeline.remeasure(release, stages, request.user), stages
        return render(
            request,
            "dashboard/confirm_remeasure.html",
            {
                "release": release,
                "stages": [(s, STAGE_LABELS[s]) for s in stages],
            },
        )

    return answer(
        request,
        attempt,
        success=lambda done: (
            f"Re-measuring {release} ({', '.join(done[1])}); its gate judges "
            "the new evidence."
        ),
        then="dashboard:release-detail",
        release_id=release.pk,
    )
