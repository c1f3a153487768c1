"""The deploy checks of the Redis URLs (controlplane/dispatch/checks.py), as
`manage.py check --deploy` runs them."""

import ssl

import pytest
from django.core.checks import run_checks

from controlplane.settings import redis_tls_options

CP = "rediss://releasegate-cp:s3cret@redis.internal:6380/0"


def warnings_for(settings, broker: str, backend: str = "db+sqlite:///r.db"):
    settings.CELERY_BROKER_URL = broker
    settings.CELERY_BROKER_USE_SSL = redis_tls_options(broker)
    settings.CELERY_RESULT_BACKEND = backend
    settings.CELERY_REDIS_BACKEND_USE_SSL = redis_tls_options(backend) or None
    found = run_checks(include_deployment_checks=True)
    return [(w.id, w.msg) for w in found if w.id.startswith("releasegate.")]


def test_it_accepts_tls_with_an_acl_user(settings):
    assert warnings_for(settings, CP, backend=CP.replace("/0", "/1")) == []
    assert warnings_for(settings, CP + "?ssl_ca_certs=/etc/ssl/redis-ca.pem") == []


def test_it_says_nothing_of_the_embedded_transport(settings):
    assert warnings_for(settings, "sqla+sqlite:///var/celery-broker.sqlite3") == []


def test_it_warns_of_plain_redis_without_a_user(settings):
    found = warnings_for(settings, "redis://redis.internal:6379/0")

    assert [id for id, _ in found] == ["releasegate.W001", "releasegate.W003"]
    assert "CELERY_BROKER_URL is a plain redis:// URL" in found[0][1]
    assert "default user without a password" in found[1][1]


@pytest.mark.parametrize(
    "url",
    [
        "rediss://:s3cret@redis.internal:6380/0",  # requirepass: the default user
        "rediss://default:s3cret@redis.internal:6380/0",
        "rediss://releasegate-cp@redis.internal:6380/0",
    ],
)
def test_it_warns_of_the_default_user_or_no_password(settings, url):
    assert [id for id, _ in warnings_for(settings, url)] == ["releasegate.W003"]


def test_it_warns_of_tls_that_does_not_check_the_certificate(settings):
    found = warnings_for(settings, CP + "?ssl_cert_reqs=none")

    assert [id for id, _ in found] == ["releasegate.W002"]


def test_it_checks_the_result_backend_too(settings):
    found = warnings_for(settings, CP, backend="redis://redis.internal:6379/1")

    assert [id for id, _ in found] == ["releasegate.W001", "releasegate.W003"]
    assert found[0][1].startswith("CELERY_RESULT_BACKEND")


def test_it_checks_the_certificate_of_rediss_by_default():
    assert redis_tls_options(CP) == {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    assert redis_tls_options("redis://redis.internal:6379/0") is False
