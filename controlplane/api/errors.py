"""One JSON error body for every 4xx/5xx the API answers.

    {"error": {"code": "<slug>", "message": "<human text>", ...extra}}

Validation errors add `fields`: a list of {"field", "message", "type", "location"} where
`field` is the dotted path inside the body/query ("recipe.weights"), so a client can
point at the input it got wrong. A missing scope adds `scope`. The handlers are
registered on the NinjaAPI in `controlplane.api.main`.
"""

import logging
from typing import Any

from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from django.http import Http404, HttpRequest, HttpResponse
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError

from controlplane.errors import ControlPlaneError

logger = logging.getLogger(__name__)

# Slugs for ninja's own HttpErrors (raised by ninja itself, e.g. unparsable JSON).
HTTP_STATUS_SLUGS = {
    400: "bad_request",
    401: "not_authenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    429: "throttled",
}


class ApiError(HttpError):
    """A 4xx raised by a view: status, slug and message, plus extra body keys."""

    def __init__(self, status: int, code: str, message: str, **extra: Any) -> None:
        super().__init__(status, message)
        self.code = code
        self.extra = extra


class MissingScope(ApiError):
    def __init__(self, scope: str) -> None:
        super().__init__(
            403,
            "missing_scope",
            f"this token lacks the '{scope}' scope",
            scope=scope,
        )


def error_body(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, **extra}}


def error_response(
    api: NinjaAPI, request: HttpRequest, status: int, body: dict[str, Any]
) -> HttpResponse:
    response = api.create_response(request, body, status=status)
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="releasegate"'
    return response


def _field_path(loc: tuple | list) -> tuple[str, str]:
    """ninja's loc is (source, [body param name,] *path); return (source, dotted)."""
    source, *path = loc
    # A body schema param `payload: ReleaseIn` reports ("body", "payload", "version");
    # the client never saw the name "payload", so drop it. A body that is not an
    # object at all is then the empty path: the body itself.
    if source == "body" and path:
        path = path[1:]
    return str(source), ".".join(str(part) for part in path)


def validation_fields(errors: list[dict[str, Any]]) -> list[dict[str, str]]:
    fields = []
    for err in errors:
        source, field = _field_path(err.get("loc", ("body",)))
        fields.append(
            {
                "field": field,
                "message": str(err.get("msg", "invalid")),
                "type": str(err.get("type", "invalid")),
                "location": source,
            }
        )
    return fields


def install_error_handlers(api: NinjaAPI) -> None:
    @api.exception_handler(ValidationError)
    def on_validation_error(request: HttpRequest, exc: ValidationError) -> HttpResponse:
        fields = validation_fields(exc.errors)
        names = ", ".join(sorted({f["field"] or f["location"] for f in fields}))
        body = error_body("validation_error", f"invalid input: {names}", fields=fields)
        return error_response(api, request, 422, body)

    @api.exception_handler(ControlPlaneError)
    def on_control_plane_error(
        request: HttpRequest, exc: ControlPlaneError
    ) -> HttpResponse:
        extra: dict[str, Any] = {}
        if exc.field:
            extra["fields"] = [
                {"field": exc.field, "message": exc.message, "type": exc.slug}
            ]
        body = error_body(exc.slug, exc.message, **extra)
        return error_response(api, request, exc.code, body)

    @api.exception_handler(HttpError)
    def on_http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
        if isinstance(exc, ApiError):
            body = error_body(exc.code, exc.message, **exc.extra)
        elif isinstance(exc, AuthenticationError):
            body = error_body(
                "not_authenticated",
                "valid credentials required: Authorization: Bearer <token>",
            )
        else:
            code = HTTP_STATUS_SLUGS.get(exc.status_code, "error")
            body = error_body(code, exc.message)
        return error_response(api, request, exc.status_code, body)

    @api.exception_handler(Http404)
    def on_not_found(request: HttpRequest, exc: Http404) -> HttpResponse:
        body = error_body("not_found", "no such object")
        return error_response(api, request, 404, body)

    @api.exception_handler(SuspiciousOperation)
    def on_suspicious_request(
        request: HttpRequest, exc: SuspiciousOperation
    ) -> HttpResponse:
        # Django answers these 400 outside ninja (a body over
        # DATA_UPLOAD_MAX_MEMORY_SIZE, too many query fields); inside ninja they would
        # fall through to the 500 below although the request is at fault.
        logger.warning("refused %s %s: %s", request.method, request.path, exc)
        if isinstance(exc, RequestDataTooBig):
            body = error_body("request_too_large", str(exc))
            return error_response(api, request, 413, body)
        return error_response(api, request, 400, error_body("bad_request", str(exc)))

    @api.exception_handler(Exception)
    def on_unexpected(request: HttpRequest, exc: Exception) -> HttpResponse:
        # A bug, never the client's fault: log the traceback, keep the body format.
        logger.exception("unhandled API error on %s %s", request.method, request.path)
        body = error_body("internal_error", "internal server error")
        return error_response(api, request, 500, body)
