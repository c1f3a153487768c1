"""/api/v1/: the ninja API, plus the two answers ninja would give outside the one
error format (Django's HTML 404 for an unknown path, a plain-text 405)."""

from collections.abc import Callable
from functools import wraps

from django.core.exceptions import SuspiciousOperation
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import URLPattern, path, re_path

from controlplane.api.errors import error_body
from controlplane.api.main import api


def repeated_query_parameters(request: HttpRequest) -> JsonResponse | None:
    """A 422 naming each query parameter given more than once: every parameter
    takes one value, and silently using the last would hide a client's mistake."""
    try:
        repeated = sorted(k for k, v in request.GET.lists() if len(v) > 1)
    except SuspiciousOperation:
        return None  # (too many fields) ninja reads the query again and says so
    if not repeated:
        return None
    fields = [
        {
            "field": name,
            "message": "given more than once; it takes one value",
            "type": "repeated",
            "location": "query",
        }
        for name in repeated
    ]
    body = error_body(
        "validation_error", f"invalid input: {', '.join(repeated)}", fields=fields
    )
    return JsonResponse(body, status=422)


def json_method_not_allowed(view: Callable[..., HttpResponse]) -> Callable:
    @wraps(view)  # keeps ninja's csrf_exempt marker
    def wrapped(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        refused = repeated_query_parameters(request)
        if refused is not None:
            return refused
        response = view(request, *args, **kwargs)
        if response.status_code != 405:
            return response
        allowed = response.get("Allow", "")
        body = error_body(
            "method_not_allowed",
            f"{request.method} is not allowed here; allowed: {allowed}",
        )
        return JsonResponse(body, status=405, headers={"Allow": allowed})

    return wrapped


def no_such_endpoint(request: HttpRequest, rest: str) -> JsonResponse:
    return JsonResponse(
        error_body("not_found", f"no such endpoint: /api/v1/{rest}"), status=404
    )


# (Not named app_name/namespace: include() would read those off this module.)
ninja_patterns, ninja_app_name, ninja_namespace = api.urls
for pattern in ninja_patterns:
    if isinstance(pattern, URLPattern):
        pattern.callback = json_method_not_allowed(pattern.callback)

urlpatterns = [
    path("", (ninja_patterns, ninja_app_name, ninja_namespace)),
    re_path(r"^(?P<rest>.*)$", no_such_endpoint),
]
