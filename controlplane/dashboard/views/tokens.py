"""API tokens on the dashboard, so that a newcomer with an account needs no shell
on the server: make one (in one of your teams, with scopes your role there
allows), see its secret once on the answer to that post (never again: only its
sha256 is stored, listings show a prefix), list yours (a team admin sees the
team's), revoke one behind a confirmation. Every write goes through the accounts
actions, audited as done by the signed-in user."""

from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import render
from django.views.decorators.http import require_POST

from controlplane.accounts.actions import (
    check_revoke_api_token,
    do_create_api_token,
    do_revoke_api_token,
)
from controlplane.accounts.models import ApiToken
from controlplane.dashboard.forms import ApiTokenForm
from controlplane.dashboard.views.outcome import answer, confirmed
from controlplane.errors import Conflict, ControlPlaneError


def _visible_tokens(user):
    return ApiToken.objects.visible_to(user).select_related("team", "user")


@login_required
def token_list(request):
    ctx = {"tokens": _visible_tokens(request.user)}
    return render(request, "dashboard/tokens.html", ctx)


@login_required
def create_token(request):
    form = ApiTokenForm(request.user, request.POST or None)
    status = 200
    if request.method == "POST":
        status = 400
        if form.is_valid():
            data = form.cleaned_data
            try:
                token, plaintext = do_create_api_token(
                    request.user,
                    data["team"],
                    data["name"],
                    data["scopes"],
                    actor=request.user,
                )
            except ControlPlaneError as exc:
                field = exc.field if exc.field in form.fields else None
                form.add_error(field, exc.message)
                status = exc.code
            else:
                ctx = {"token": token, "plaintext": plaintext}
                response = render(request, "dashboard/token_created.html", ctx)
                # The secret is in this answer only: no cache may keep it.
                response["Cache-Control"] = "no-store"
                return response
    return render(request, "dashboard/token_new.html", {"form": form}, status=status)


@require_POST
@login_required
def revoke_token(request, token_id: int):
    token = _visible_tokens(request.user).filter(pk=token_id).first()
    if token is None:
        raise Http404("no such token")

    def attempt():
        check_revoke_api_token(token, request.user)
        if not token.is_active:
            raise Conflict(f"{token} was revoked already")
        if not confirmed(request):
            return render(
                request, "dashboard/confirm_revoke_token.html", {"token": token}
            )
        return do_revoke_api_token(token, actor=request.user)

    return answer(
        request,
        attempt,
        success=lambda revoked: f"Revoked {revoked}: it no longer works.",
        then="dashboard:token-list",
    )
