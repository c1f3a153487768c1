"""The shared cast for every control-plane test (dashboard and API alike):

- `team` ("Acme ML") with `owner` (admin) and `teammate` (approver);
- `outsider`, a member of `other_team`, who must see nothing of `team`;
- `environment` (team's "staging"), `model_family`, `release` (registered by owner);
- factories `make_environment`, `make_model_family`, `make_release` for more;
- `expire_lease(job)`: the job's worker "died" a second ago.

Every user's password is PASSWORD.
"""

import itertools
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from controlplane.accounts.models import Membership, Team
from controlplane.fleet.models import Environment
from controlplane.releases.actions import do_register_release
from controlplane.releases.models import Job, ModelFamily, Release

PASSWORD = "correct-horse-battery"
RECIPE = {"weights": "int4-g128", "kv_cache_dtype": "int8"}


@pytest.fixture(autouse=True)
def _fast_password_hasher(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _user(username: str) -> User:
    return User.objects.create_user(
        username, email=f"{username}@example.org", password=PASSWORD
    )


@pytest.fixture
def team(db) -> Team:
    return Team.objects.create(name="Acme ML", slug="acme")


@pytest.fixture
def other_team(db) -> Team:
    return Team.objects.create(name="Other Co", slug="other")


@pytest.fixture
def owner(team) -> User:
    user = _user("alice")
    Membership.objects.create(team=team, user=user, role="admin")
    return user


@pytest.fixture
def teammate(team) -> User:
    user = _user("bob")
    Membership.objects.create(team=team, user=user, role="approver")
    return user


@pytest.fixture
def member(team) -> User:
    """A plain member of `team`: may register and promote, not approve."""
    user = _user("carol")
    Membership.objects.create(team=team, user=user, role="member")
    return user


@pytest.fixture
def outsider(other_team) -> User:
    user = _user("mallory")
    Membership.objects.create(team=other_team, user=user, role="admin")
    return user


@pytest.fixture
def make_environment(team):
    def make(name: str = "staging", *, of_team: Team | None = None) -> Environment:
        return Environment.objects.create(team=of_team or team, name=name)

    return make


@pytest.fixture
def environment(make_environment) -> Environment:
    return make_environment("staging")


@pytest.fixture
def make_model_family(team):
    def make(name: str = "llama-support", *, of_team: Team | None = None):
        return ModelFamily.objects.create(
            team=of_team or team, name=name, description=f"{name} family"
        )

    return make


@pytest.fixture
def model_family(make_model_family) -> ModelFamily:
    return make_model_family("llama-support")


@pytest.fixture
def make_release(model_family, environment, owner):
    """make_release(version=None, state=None, **fields): registered through the action
    by `owner`; `state` then forces the row into any state (test setup only)."""
    versions = itertools.count(1)

    def make(
        version: str | None = None,
        *,
        state: str | None = None,
        family: ModelFamily | None = None,
        target_environment: Environment | None = None,
        source_uri: str = "s3://acme-models/llama-support",
        recipe: dict | None = None,
        actor=None,
        **fields,
    ) -> Release:
        release, _ = do_register_release(
            family or model_family,
            version=version or f"1.0.{next(versions)}",
            source_uri=source_uri,
            recipe=recipe or RECIPE,
            target_environment=target_environment or environment,
            actor=actor or owner,
        )
        if state is not None:
            fields["state"] = state
        if fields:
            Release.objects.filter(pk=release.pk).update(**fields)
            release.refresh_from_db()
        return release

    return make


@pytest.fixture
def release(make_release) -> Release:
    return make_release("1.0.0")


@pytest.fixture
def expire_lease():
    """expire_lease(job): let the job's lease run out, as when its worker dies."""

    def expire(job: Job) -> None:
        Job.objects.filter(pk=job.pk).update(
            lease_expires=timezone.now() - timedelta(seconds=1)
        )

    return expire
