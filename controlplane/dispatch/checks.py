"""Deploy-time checks (`manage.py check --deploy`) of the Redis the control plane
and the agents talk through: it carries every job request and result, so it is
a trust boundary. Warned: a plain redis:// URL (messages in clear), rediss://
that does not check the server's certificate, and no ACL user of its own (Redis's
default user, or no password at all: anyone who reaches Redis can read and
forge messages)."""

import ssl

from django.conf import settings
from django.core.checks import Tags, Warning, register
from kombu import Connection

REDIS_SCHEMES = ("redis", "rediss")


def redis_transport_warnings(setting: str, url: str, tls_options) -> list[Warning]:
    """What is missing from the Redis URL in `setting` (with the TLS options the
    app hands kombu: ssl_* parameters in the URL replace them)."""
    scheme = url.partition("://")[0]
    if scheme not in REDIS_SCHEMES:
        return []  # the embedded transport, or a Unix socket: no network to cross
    connection = Connection(url, ssl=tls_options or False)
    found = []
    if scheme == "redis":
        found.append(
            Warning(
                f"{setting} is a plain redis:// URL: what it carries crosses the "
                "network in clear.",
                hint="Use rediss:// (Redis with TLS); see the README, Redis.",
                id="releasegate.W001",
            )
        )
    elif _cert_reqs(connection.ssl) != ssl.CERT_REQUIRED:
        found.append(
            Warning(
                f"{setting} uses TLS without checking Redis's certificate.",
                hint="Drop ssl_cert_reqs=none/optional from the URL; name the "
                "CA with ssl_ca_certs=/path if it is not a system one.",
                id="releasegate.W002",
            )
        )
    if not connection.password or connection.userid in (None, "", "default"):
        found.append(
            Warning(
                f"{setting} logs in as Redis's default user"
                + ("" if connection.password else " without a password")
                + ": whoever reaches Redis can read and forge messages.",
                hint="Give the control plane and each agent their own Redis ACL "
                "user (rediss://USER:PASSWORD@host...); see the README, Redis.",
                id="releasegate.W003",
            )
        )
    return found


def _cert_reqs(options) -> ssl.VerifyMode | None:
    """The certificate check kombu will ask for (redis-py's default, with TLS
    options that do not say, is "required")."""
    if not isinstance(options, dict):
        return None
    value = options.get("ssl_cert_reqs", ssl.CERT_REQUIRED)
    names = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL}
    names["none"] = ssl.CERT_NONE
    return names.get(value, value) if isinstance(value, str) else value


@register(Tags.security, deploy=True)
def check_redis_transport(app_configs, **kwargs) -> list[Warning]:
    return redis_transport_warnings(
        "CELERY_BROKER_URL",
        settings.CELERY_BROKER_URL,
        getattr(settings, "CELERY_BROKER_USE_SSL", False),
    ) + redis_transport_warnings(
        "CELERY_RESULT_BACKEND",
        settings.CELERY_RESULT_BACKEND,
        getattr(settings, "CELERY_REDIS_BACKEND_USE_SSL", None),
    )
