"""The one writer of AuditEvent rows. Callers run it inside their own transaction so
the event commits or rolls back with the change it describes."""

from django.contrib.auth.models import AbstractBaseUser

from controlplane.accounts.models import ApiToken
from controlplane.audit.models import AuditEvent

# Who did something: a user (dashboard), a token (API), or a named system component
# ("system:worker"). None means the system without a finer name.
Actor = AbstractBaseUser | ApiToken | str | None


def actor_fields(actor: Actor) -> dict:
    if isinstance(actor, ApiToken):
        return {
            "actor_user": actor.user,
            "actor_token": actor,
            "actor_name": actor.actor_name,
        }
    if isinstance(actor, AbstractBaseUser):
        return {"actor_user": actor, "actor_name": actor.get_username()}
    return {"actor_name": actor or "system"}


def do_record_event(
    actor: Actor,
    verb: str,
    obj,
    *,
    before: dict | None = None,
    after: dict | None = None,
    team=None,
) -> AuditEvent:
    return AuditEvent.objects.create(
        team=team,
        verb=verb,
        object_type=obj._meta.model_name,
        object_id=str(obj.pk),
        before=before or {},
        after=after or {},
        **actor_fields(actor),
    )
