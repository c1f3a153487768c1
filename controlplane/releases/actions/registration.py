"""Registering releases and model families."""

import hashlib
import json

from django.db import IntegrityError, transaction
from pydantic import ValidationError

from controlplane.accounts.actions import (
    check_actor_in_team,
    team_source_roots,
    user_of,
)
from controlplane.accounts.models import ApiToken, Team
from controlplane.audit.actions import Actor, do_record_event
from controlplane.errors import (
    Conflict,
    ConflictingRegistration,
    ValidationFailed,
    validation_failed,
)
from controlplane.fleet.models import Environment
from controlplane.releases.models import (
    ModelFamily,
    Release,
)
from controlplane.releases.sources import (
    SourceRefused,
    resolve_source,
)
from gpuagent.protocol import Recipe


def do_create_model_family(
    team: Team, name: str, *, actor: Actor, description: str = ""
) -> ModelFamily:
    check_actor_in_team(actor, team, scope="register")
    name = name.strip()
    if not name:
        raise ValidationFailed("name must not be empty", field="name")
    try:
        with transaction.atomic():
            family = ModelFamily.objects.create(
                team=team, name=name, description=description
            )
            do_record_event(
                actor, "model.created", family, after=family.to_dict(), team=team
            )
    except IntegrityError as exc:
        raise Conflict(
            f"model {name!r} already exists in team {team.slug}", field="name"
        ) from exc
    return family


def registration_body_digest(
    family: ModelFamily,
    *,
    version: str,
    source_uri: str,
    recipe: dict,
    target_environment: Environment,
    parent: Release | None,
) -> str:
    body = {
        "model": family.name,
        "version": version,
        "source_uri": source_uri,
        "recipe": recipe,
        "target_environment": target_environment.name,
        "parent": parent.pk if parent else None,
    }
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _validated_recipe(recipe: dict) -> dict:
    try:
        return Recipe.model_validate(recipe).model_dump(exclude_defaults=True)
    except ValidationError as exc:
        raise validation_failed(exc, "recipe") from exc


def check_source_uri(team: Team, source_uri: str) -> None:
    """ValidationFailed (on source_uri) unless the URI names a folder inside one of
    `team`'s source roots, reached without symlinks or '..' (see sources.py)."""
    try:
        resolve_source(source_uri, team_source_roots(team))
    except SourceRefused as exc:
        raise ValidationFailed(str(exc), field="source_uri") from exc


def do_register_release(
    model_family: ModelFamily,
    *,
    version: str,
    source_uri: str,
    recipe: dict,
    target_environment: Environment,
    actor: Actor,
    parent: Release | None = None,
) -> tuple[Release, bool]:
    """Register a release; returns (release, created). Registering the same body
    again returns the existing release with created=False; a different body for the
    same model and version raises ConflictingRegistration."""
    team = model_family.team
    check_actor_in_team(actor, team, scope="register")
    version = version.strip()
    if not version or len(version) > 100:
        raise ValidationFailed("version must be 1..100 characters", field="version")
    if not source_uri.strip():
        raise ValidationFailed("source_uri must not be empty", field="source_uri")
    check_source_uri(team, source_uri)
    if target_environment.team_id != team.id:
        raise ValidationFailed(
            f"environment {target_environment.name!r} is not in team {team.slug}",
            field="target_environment",
        )
    if parent is not None and parent.model.team_id != team.id:
        raise ValidationFailed("parent release is in another team", field="parent")
    recipe = _validated_recipe(recipe)
    digest = registration_body_digest(
        model_family,
        version=version,
        source_uri=source_uri,
        recipe=recipe,
        target_environment=target_environment,
        parent=parent,
    )

    def existing_or_conflict(existing: Release) -> tuple[Release, bool]:
        if existing.registration_body_digest != digest:
            raise ConflictingRegistration(
                f"{model_family.name}@{version} is already registered with a "
                "different body"
            )
        return existing, False

    existing = Release.objects.filter(model=model_family, version=version).first()
    if existing is not None:
        return existing_or_conflict(existing)
    try:
        with transaction.atomic():
            release = Release.objects.create(
                model=model_family,
                version=version,
                source_uri=source_uri,
                recipe=recipe,
                target_environment=target_environment,
                parent=parent,
                created_by=user_of(actor),
                created_by_token=actor if isinstance(actor, ApiToken) else None,
                registration_body_digest=digest,
            )
            do_record_event(
                actor, "release.registered", release, after=release.to_dict(), team=team
            )
    except IntegrityError:
        # A concurrent registration of the same model+version won the race.
        return existing_or_conflict(
            Release.objects.get(model=model_family, version=version)
        )
    return release, True
