from collections.abc import Callable
from functools import wraps

from django import template

from controlplane.costs.money import format_money

register = template.Library()
NOTHING = "—"


def _dash_for_none(function: Callable[..., str]) -> Callable[..., str]:
    """A missing number (None, or "" from a failed lookup) shows as a dash."""

    @wraps(function)
    def wrapper(value, *args) -> str:
        if value is None or value == "":
            return NOTHING
        return function(value, *args)

    return wrapper


@register.filter
@_dash_for_none
def percent(fraction, digits: int = 1) -> str:
    """0.9861 -> "98.6%"."""
    return f"{float(fraction) * 100:.{int(digits)}f}%"


@register.filter
@_dash_for_none
def seconds(value) -> str:
    """A duration for people: "13 ms", "4.2 s", "3 min 05 s", "2 h 04 min"."""
    value = float(value)
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f} s"
    minutes, secs = divmod(int(value), 60)
    if minutes < 120:
        return f"{minutes} min {secs:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


@register.filter
@_dash_for_none
def sig(value, digits: int = 4) -> str:
    """A number to `digits` significant digits: 292.43076 -> "292.4"."""
    return f"{float(value):.{int(digits)}g}"


@register.filter
@_dash_for_none
def binary_size(value) -> str:
    """Bytes in IEC units: 85899345920 -> "80.0 GiB" (filesizeformat says "GB" for
    GiB, which is 7% off at this scale)."""
    size = float(value)
    if size < 1024:
        return f"{size:.0f} bytes"
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}"
    raise AssertionError("unreachable")


@register.filter
@_dash_for_none
def money(value, currency: str) -> str:
    """A Decimal amount with its currency and thousands separators:
    Decimal("4500") with "KRW" -> "4,500 KRW"; None -> "—", never a silent 0."""
    return format_money(value, currency)


@register.filter
@_dash_for_none
def signed_money(value, currency: str) -> str:
    """A difference: "+1,460.00 USD", "-730.00 USD", "0.00 USD"."""
    return ("+" if value > 0 else "") + format_money(value, currency)


@register.filter
@_dash_for_none
def signed(value) -> str:
    """A whole difference: +3, -2, 0."""
    return f"{int(value):+d}" if value else "0"
