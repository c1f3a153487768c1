"""DELETE /api/v1/tokens/{id}: its user or the team's admins revoke a token; it
answers 401 from then on; an outsider gets a 404 and revokes nothing."""

from controlplane.accounts.models import TOKEN_PREFIX_LENGTH, ApiToken
from controlplane.audit.models import AuditEvent
from tests.controlplane.api.helpers import error_of

RELEASES = "/api/v1/releases"


def url(token: ApiToken) -> str:
    return f"/api/v1/tokens/{token.pk}"


def token_of(plaintext: str) -> ApiToken:
    return ApiToken.lookup(plaintext)


def test_it_revokes_a_members_token(api, admin_token, approver_token):
    bobs = token_of(approver_token)

    response = api.delete(url(bobs), token=admin_token)

    assert response.status_code == 204, response.content
    error_of(api.get(RELEASES, token=approver_token), 401, "not_authenticated")
    assert ApiToken.objects.get(pk=bobs.pk).revoked is not None
    event = AuditEvent.objects.get(verb="api_token.revoked")
    prefix = admin_token[:TOKEN_PREFIX_LENGTH]
    assert event.actor_name == f"token:{prefix} (alice-read-admin, alice)"
    assert api.delete(url(bobs), token=admin_token).status_code == 204  # idempotent
    assert AuditEvent.objects.filter(verb="api_token.revoked").count() == 1


def test_it_revokes_the_calling_token(api, admin_token):
    response = api.delete(url(token_of(admin_token)), token=admin_token)

    assert response.status_code == 204, response.content
    error_of(api.get(RELEASES, token=admin_token), 401, "not_authenticated")


def test_it_shows_a_member_only_their_own(api, make_token, teammate, owner_token):
    bobs_admin = make_token(teammate, "read", "admin")

    error_of(api.delete(url(token_of(owner_token)), token=bobs_admin), 404, "not_found")
    assert api.get(RELEASES, token=owner_token).status_code == 200
    assert api.delete(url(token_of(bobs_admin)), token=bobs_admin).status_code == 204


def test_it_shows_the_outsider_nothing(api, outsider_token, owner_token):
    response = api.delete(url(token_of(owner_token)), token=outsider_token)

    error_of(response, 404, "not_found")
    assert api.get(RELEASES, token=owner_token).status_code == 200
    own = api.delete(url(token_of(outsider_token)), token=outsider_token)
    assert own.status_code == 204
