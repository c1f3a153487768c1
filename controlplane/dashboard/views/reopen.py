"""Reopen a rejected or failed release, in the two steps of views/outcome.py: the
form on the release page posts here with a reason, the answer is a confirmation
page saying what reopening does, and only its "Confirm" post calls
do_reopen_release, the action behind the API's POST .../reopen, with the same
rule on who may (any member of the release's team)."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.views.decorators.http import require_POST

from controlplane.dashboard import access
from controlplane.dashboard.views.outcome import answer, confirmed
from controlplane.errors import ValidationFailed
from controlplane.releases.actions.promotion import (
    check_reopen_release,
    do_reopen_release,
)


@require_POST
@login_required
def reopen_release(request, release_id: int):
    release = access.release_or_404(request.user, release_id)
    reason = request.POST.get("reason", "").strip()

    def attempt():
        if confirmed(request):
            return do_reopen_release(release, request.user, reason=reason)
        # The action's checks, before asking to confirm: who (403), then what.
        check_reopen_release(release, request.user)
        if not reason:
            raise ValidationFailed("reopening needs a reason", field="reason")
        return render(
            request,
            "dashboard/confirm_reopen.html",
            {"release": release, "reason": reason},
        )

    return answer(
        request,
        attempt,
        success=lambda _: f"Reopened {release}: it is registered again.",
        then="dashboard:release-detail",
        release_id=release.pk,
    )
