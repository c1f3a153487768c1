from django.http import HttpRequest
from django.shortcuts import get_object_or_404
from ninja import Router, Status

from controlplane.api.auth import read_auth, token_auth
from controlplane.api.schemas import (
    READ_ERRORS,
    WRITE_ERRORS,
    ObjectId,
    WebhookCreatedOut,
    WebhookIn,
    WebhookOut,
)
from controlplane.api.scoping import get_environment, principal_of
from controlplane.webhooks.actions import do_create_webhook, do_delete_webhook

router = Router(tags=["environments"])


@router.post(
    "/environments/{environment_id}/webhooks",
    auth=token_auth("admin"),
    response={201: WebhookCreatedOut, **WRITE_ERRORS},
    summary="Add a webhook for the environment's release state changes (admin role)",
    description="Every state change of a release targeting the environment is POSTed "
    "to `url`, signed: `X-Releasegate-Signature: t=<unix s>,v1=<hex HMAC-SHA256 of "
    "'<t>.' + body, keyed with the secret>`. The secret is in this answer only.",
)
def create_webhook(
    request: HttpRequest, environment_id: ObjectId, payload: WebhookIn
) -> Status:
    principal = principal_of(request)
    environment = get_environment(principal, environment_id)
    webhook, secret = do_create_webhook(environment, payload.url, actor=principal.token)
    body = {**webhook.to_dict(), "secret": secret, "full_url": webhook.url}
    return Status(201, body)


@router.get(
    "/environments/{environment_id}/webhooks",
    auth=read_auth(),
    response={200: list[WebhookOut], **READ_ERRORS},
    summary="The environment's webhooks: scheme and host of each, never a secret",
)
def list_webhooks(request: HttpRequest, environment_id: ObjectId) -> list[dict]:
    environment = get_environment(principal_of(request), environment_id)
    return [w.to_dict() for w in environment.webhooks.select_related("environment")]


@router.delete(
    "/environments/{environment_id}/webhooks/{webhook_id}",
    auth=token_auth("admin"),
    response={204: None, **WRITE_ERRORS},
    summary="Remove a webhook (admin role)",
)
def delete_webhook(
    request: HttpRequest, environment_id: ObjectId, webhook_id: ObjectId
) -> Status:
    principal = principal_of(request)
    environment = get_environment(principal, environment_id)
    webhook = get_object_or_404(environment.webhooks, pk=webhook_id)
    do_delete_webhook(webhook, actor=principal.token)
    return Status(204, None)
