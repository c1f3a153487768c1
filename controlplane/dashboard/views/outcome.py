"""How every dashboard form post answers. A post is two steps: without
confirmed=yes it answers a confirmation page that repeats what is about to happen;
with it, it calls the action. Either way a Forbidden is a 403 naming why, any other
ControlPlaneError a message on the page the post came from, success a message and
a redirect."""

from collections.abc import Callable

from django.contrib import messages
from django.http import HttpResponse, HttpResponseForbidden
from django.shortcuts import redirect

from controlplane.errors import ControlPlaneError, Forbidden

CONFIRMED = "yes"


def confirmed(request) -> bool:
    return request.POST.get("confirmed") == CONFIRMED


def answer(
    request, attempt: Callable, *, success: Callable[..., str], then: str, **kwargs
) -> HttpResponse:
    """Run `attempt()` (the view's checks, then a confirmation page or the action)
    and answer as the module says; `success(result)` words the success message,
    `then` (with `kwargs`) names the page to go back to."""
    try:
        result = attempt()
    except Forbidden as exc:
        return HttpResponseForbidden(exc.message)
    except ControlPlaneError as exc:
        messages.error(request, exc.message)
    else:
        if isinstance(result, HttpResponse):
            return result
        messages.success(request, success(result))
    return redirect(then, **kwargs)
