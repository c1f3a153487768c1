import ipaddress

import pytest

from controlplane.errors import ValidationFailed
from controlplane.webhooks.actions import check_webhook_url
from controlplane.webhooks.addresses import embedded_ipv4, why_refused


def teredo(server: str, client: str) -> str:
    """2001:0:<server>:<flags>:<port>:<client>, port and client bits inverted."""
    high = (0x2001 << 112) | (int(ipaddress.IPv4Address(server)) << 64)
    low = ((0xFFFF ^ 443) << 32) | (int(ipaddress.IPv4Address(client)) ^ 0xFFFFFFFF)
    return str(ipaddress.IPv6Address(high | low))


PRIVATE_FORMS = [
    ("64:ff9b::7f00:1", "127.0.0.1"),  # NAT64, well-known prefix
    ("64:ff9b::a9fe:a9fe", "169.254.169.254"),
    ("2002:a00:1::1", "10.0.0.1"),  # 6to4
    ("2002:c0a8:101::", "192.168.1.1"),
    ("::ffff:127.0.0.1", "127.0.0.1"),  # IPv4-mapped
    ("::ffff:172.16.0.1", "172.16.0.1"),
    ("::10.0.0.1", "10.0.0.1"),  # IPv4-compatible
    (teredo("8.8.8.8", "127.0.0.1"), "127.0.0.1"),  # Teredo client
    (teredo("10.0.0.1", "8.8.8.8"), "10.0.0.1"),  # Teredo server
]


@pytest.mark.parametrize("form, inner", PRIVATE_FORMS)
def test_it_finds_the_embedded_ipv4_address(form, inner):
    assert ipaddress.IPv4Address(inner) in embedded_ipv4(ipaddress.ip_address(form))


@pytest.mark.parametrize("form, inner", PRIVATE_FORMS)
def test_it_refuses_every_form_of_a_private_ipv4_address(form, inner, settings):
    settings.RELEASEGATE_WEBHOOK_ALLOW_PRIVATE = False

    assert why_refused(ipaddress.ip_address(form))
    with pytest.raises(ValidationFailed, match="private address"):
        check_webhook_url(f"https://[{form}]/hooks")


def test_it_refuses_local_use_nat64_whole():
    why = why_refused(ipaddress.ip_address("64:ff9b:1::808:808"))
    assert why == "local-use NAT64 address 64:ff9b:1::808:808"


@pytest.mark.parametrize(
    "public",
    [
        "8.8.8.8",
        "2606:4700::1111",
        "64:ff9b::808:808",
        "2002:808:808::1",
        "::ffff:8.8.8.8",
    ],
)
def test_it_allows_public_addresses_in_any_form(public, settings):
    settings.RELEASEGATE_WEBHOOK_ALLOW_PRIVATE = False
    literal = f"[{public}]" if ":" in public else public

    assert why_refused(ipaddress.ip_address(public)) == ""
    assert check_webhook_url(f"https://{literal}/hooks")
