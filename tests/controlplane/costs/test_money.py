"""Money in Decimal, in two currencies: USD (cents) and KRW (no minor unit)."""

from decimal import Decimal

import pytest

from controlplane.costs.money import Pricing, amount, format_money, rate


@pytest.mark.parametrize(
    ("value", "currency", "rounded"),
    [
        ("0.125", "USD", "0.13"),  # half up, not to even (0.12)
        ("0.124999", "USD", "0.12"),
        ("2.5", "USD", "2.50"),
        ("1459.5", "KRW", "1460"),  # KRW has no minor unit
        ("1458.5", "KRW", "1459"),  # half up again (to even would be 1458)
        ("1458.49", "KRW", "1458"),
    ],
)
def test_it_rounds_an_amount_to_the_currencys_minor_unit(value, currency, rounded):
    result = amount(Decimal(value), currency)

    assert result == Decimal(rounded)
    assert str(result) == rounded  # the exponent is the minor unit's


@pytest.mark.parametrize(
    ("value", "currency", "rounded"),
    [
        ("0.0000114", "USD", "0.000011"),  # 4 digits past the cent
        ("0.0000115", "USD", "0.000012"),
        ("0.01543215", "KRW", "0.0154"),  # 4 digits past the won
    ],
)
def test_it_keeps_four_more_digits_for_a_rate(value, currency, rounded):
    assert str(rate(Decimal(value), currency)) == rounded


def test_it_adds_the_electricity_of_a_device_to_its_hourly_price():
    """700 W for an hour is 0.7 kWh: at 120.5 KRW per kWh, 84.35 KRW; with a
    4,500 KRW device-hour, 4,584.35 KRW. A month (730 h) of 3 devices is
    3 x 4,584.35 x 730 = 10,039,726.5 KRW, paid as 10,039,727 KRW. In USD, 350 W
    at 0.13 USD per kWh is 0.0455 USD on 2.49: 2.5355 USD an hour, and a month of
    2 devices 2 x 2.5355 x 730 = 3,701.83 USD."""
    krw = Pricing(
        "KRW",
        Decimal("4500"),
        power_draw_w=Decimal("700"),
        electricity_price_per_kwh=Decimal("120.5"),
    )
    usd = Pricing(
        "USD",
        Decimal("2.49"),
        power_draw_w=Decimal("350"),
        electricity_price_per_kwh=Decimal("0.13"),
    )

    assert krw.power_cost_per_device_hour == Decimal("84.35")
    assert krw.device_hour_cost == Decimal("4584.35")
    assert krw.monthly(3) == Decimal("10039727")
    assert usd.device_hour_cost == Decimal("2.5355")
    assert usd.monthly(2) == Decimal("3701.83")


def test_it_prices_agent_time_per_device():
    """90 s on 2 devices at 4,584.35 KRW a device-hour: 4,584.35 x 2 x 90 / 3600 =
    229.2175 KRW (a rate: four digits past the won)."""
    krw = Pricing(
        "KRW",
        Decimal("4500"),
        power_draw_w=Decimal("700"),
        electricity_price_per_kwh=Decimal("120.5"),
    )

    assert krw.agent_time(90.0, devices=2) == Decimal("229.2175")


def test_nothing_is_priced_at_zero():
    assert not Pricing("USD", Decimal(0)).priced
    assert Pricing(
        "USD", Decimal(0), Decimal("300"), Decimal("0.2")
    ).priced  # electricity alone is a cost


def test_it_shows_money_with_its_currency():
    assert format_money(Decimal("1234.5"), "USD") == "1,234.50 USD"
    assert format_money(Decimal("4500.0000"), "KRW") == "4,500 KRW"
    assert format_money(Decimal("0.000123"), "USD") == "0.000123 USD"
    assert format_money(Decimal("0"), "USD") == "0.00 USD"
    assert format_money(None, "USD") == "—"
