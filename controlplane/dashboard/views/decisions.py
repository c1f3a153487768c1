"""Approve and reject, in the two steps of views/outcome.py: the form on the release
page posts here, the answer is a confirmation page that repeats what is being
decided (the full manifest digest, the comment), and only its "Confirm" post calls
the action. Who may decide is checked first, on both steps."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.views.decorators.http import require_POST

from controlplane.dashboard import access
from controlplane.dashboard.views.outcome import answer, confirmed
from controlplane.errors import ValidationFailed
from controlplane.releases.actions.approvals import (
    check_decide_release,
    do_approve_release,
    do_reject_release,
)
from controlplane.releases.evidence import live_release_for


def _confirm(request, release, decision: str, **fields):
    ctx = {"release": release, "decision": decision, **fields}
    return render(request, "dashboard/confirm_decision.html", ctx)


@require_POST
@login_required
def approve_release(request, release_id: int):
    release = access.release_or_404(request.user, release_id)
    comment = request.POST.get("comment", "").strip()
    manifest_digest = request.POST.get("manifest_digest", "")

    def attempt():
        # Who may decide first (403), then what was sent. Like the API, an approval
        # names the digest the approver saw on the page, so a changed (or never
        # recorded) manifest is not approved unseen.
        check_decide_release(release, request.user, decision="approve")
        if not manifest_digest:
            raise ValidationFailed(
                "approve needs the manifest digest you reviewed",
                field="manifest_digest",
            )
        if confirmed(request):
            return do_approve_release(
                release, request.user, comment=comment, manifest_digest=manifest_digest
            )
        check_decide_release(
            release, request.user, decision="approve", manifest_digest=manifest_digest
        )
        return _confirm(
            request,
            release,
            "approve",
            manifest_digest=manifest_digest,
            comment=comment,
            gate_results=release.gate_results.all(),
            live_release=live_release_for(release),
        )

    return answer(
        request,
        attempt,
        success=lambda _: f"Approved {release}; deployment queued.",
        then="dashboard:release-detail",
        release_id=release.pk,
    )


@require_POST
@login_required
def reject_release(request, release_id: int):
    release = access.release_or_404(request.user, release_id)
    comment = request.POST.get("comment", "").strip()
    # The manifest the page showed: a rejection is of what was reviewed, too.
    manifest_digest = request.POST.get("manifest_digest")

    def attempt():
        # Who may decide first (403: role, separation of duties), then the reason.
        check_decide_release(release, request.user, decision="reject")
        if not comment:
            raise ValidationFailed("a rejection needs a reason", field="comment")
        if confirmed(request):
            return do_reject_release(
                release, request.user, comment=comment, manifest_digest=manifest_digest
            )
        check_decide_release(
            release, request.user, decision="reject", manifest_digest=manifest_digest
        )
        return _confirm(
            request, release, "reject", comment=comment, manifest_digest=manifest_digest
        )

    return answer(
        request,
        attempt,
        success=lambda _: f"Rejected {release}.",
        then="dashboard:release-detail",
        release_id=release.pk,
    )
