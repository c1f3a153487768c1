"""Where a webhook delivery may connect: a host name is resolved once, every address
it resolves to is checked, and the delivery connects to a checked address (never
to whatever a second lookup answers: DNS rebinding).

An address is refused when it is not global, or when it is an IPv6 form that
carries an IPv4 address that is not: NAT64 (64:ff9b::/96; the local-use
64:ff9b:1::/48 whole), 6to4 (2002::/16), IPv4-mapped (::ffff:0:0/96),
IPv4-compatible (::/96) and Teredo (2001::/32, server and client). A gateway
for those forms would take the request to the private IPv4 address."""

import ipaddress
import socket

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

NAT64_WELL_KNOWN = ipaddress.ip_network("64:ff9b::/96")
NAT64_LOCAL_USE = ipaddress.ip_network("64:ff9b:1::/48")
IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


class AddressRefused(Exception):
    """The host may not be connected to now (the message says why)."""


def embedded_ipv4(address: IPAddress) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries in one of the forms above."""
    if address.version == 4:
        return []
    low32 = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.ipv4_mapped is not None:
        return [address.ipv4_mapped]
    if address.sixtofour is not None:
        return [address.sixtofour]
    if address.teredo is not None:
        return list(address.teredo)
    if address in NAT64_WELL_KNOWN or address in IPV4_COMPATIBLE:
        return [low32]
    return []


def why_refused(address: IPAddress) -> str:
    """Why a delivery must not connect to `address`, or "" when it may."""
    if address in NAT64_LOCAL_USE:
        return f"local-use NAT64 address {address}"
    if not address.is_global:
        return f"private address {address}"
    for inner in embedded_ipv4(address):
        if not inner.is_global:
            return f"address {address}, which embeds private address {inner}"
    return ""


def resolve_checked(host: str, port: int, *, allow_private: bool) -> list[IPAddress]:
    """The addresses `host` resolves to, once, in the resolver's order; each was
    checked (unless `allow_private`). AddressRefused when one of them is refused
    (a name that answers with a private address among public ones is not
    trusted either) or the name does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise AddressRefused(f"cannot resolve {host}: {exc}") from exc
    found: list[IPAddress] = []
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%", 1)[0])
        if address not in found:
            found.append(address)
    for address in found if not allow_private else []:
        why = why_refused(address)
        if why:
            raise AddressRefused(f"{host} resolves to {why}")
    if not found:
        raise AddressRefused(f"cannot resolve {host}: no address")
    return found
