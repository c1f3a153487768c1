"""/favicon.ico, which browsers ask for on a site's first page and on every page
that names no icon (the Django admin, the API docs): a redirect to the static icon,
so it is served and cached as the stylesheet is. Dashboard pages name theirs in
base.html."""

from django.http import HttpResponseRedirect
from django.templatetags.static import static
from django.utils.cache import patch_cache_control
from django.views.decorators.http import require_safe

FAVICON = "dashboard/favicon.ico"
# Not permanent: the static URL may change (a new STATIC_URL, hashed names).
REDIRECT_MAX_AGE_S = 24 * 3600


@require_safe
def favicon(request):
    response = HttpResponseRedirect(static(FAVICON))
    patch_cache_control(response, public=True, max_age=REDIRECT_MAX_AGE_S)
    return response
