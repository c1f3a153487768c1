import hashlib

import pytest
from django.utils import timezone

from controlplane.accounts.models import ApiToken


def test_it_stores_only_the_hash(owner, team):
    token, plaintext = ApiToken.create(owner, team, "ci", ["read", "register"])

    stored = ApiToken.objects.get(pk=token.pk)
    assert stored.token_hash == hashlib.sha256(plaintext.encode()).hexdigest()
    assert stored.prefix == plaintext[:8]
    assert plaintext not in str(stored.to_dict())
    assert stored.scopes == ["read", "register"]


def test_it_looks_up_a_token_by_its_plaintext(owner, team):
    token, plaintext = ApiToken.create(owner, team, "ci", ["read"])

    assert ApiToken.lookup(plaintext) == token


@pytest.mark.parametrize("mangle", [lambda p: p[:-1] + "x", lambda p: p[:8], str.upper])
def test_it_refuses_wrong_plaintexts(owner, team, mangle):
    _, plaintext = ApiToken.create(owner, team, "ci", ["read"])

    assert ApiToken.lookup(mangle(plaintext)) is None


def test_it_refuses_revoked_tokens(owner, team):
    token, plaintext = ApiToken.create(owner, team, "ci", ["read"])
    ApiToken.objects.filter(pk=token.pk).update(revoked=timezone.now())

    assert ApiToken.lookup(plaintext) is None


def test_it_refuses_tokens_of_deactivated_users(owner, team):
    _, plaintext = ApiToken.create(owner, team, "ci", ["read"])
    owner.is_active = False
    owner.save()

    assert ApiToken.lookup(plaintext) is None


def test_it_refuses_unknown_scopes(owner, team):
    with pytest.raises(ValueError):
        ApiToken.create(owner, team, "ci", ["read", "root"])


def test_it_refuses_an_empty_plaintext(db):
    assert ApiToken.lookup("") is None
