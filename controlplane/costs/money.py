"""Money as Decimal in a currency's minor units: pure functions, no Django.

Two precisions. An *amount* (what is paid: a device-hour, a month) is rounded to the
currency's minor unit (USD cents, whole KRW). A *rate* (per request, per 1M tokens,
the agent time of one verification) keeps RATE_EXTRA_DIGITS more: a request costs a
fraction of a cent, and rounding it to 0.00 would be the silent zero a price list
must never show. Rounding is half up (0.125 USD is 0.13), as a person rounds money
by hand.
"""

from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal

# Minor units per ISO 4217: the number of decimals an amount is paid in.
CURRENCY_MINOR_UNITS = {"USD": 2, "EUR": 2, "KRW": 0, "JPY": 0}
CURRENCIES = tuple(CURRENCY_MINOR_UNITS)
RATE_EXTRA_DIGITS = 4
# A month of a device kept running: 8760 hours a year / 12.
HOURS_PER_MONTH = Decimal(730)
SECONDS_PER_HOUR = Decimal(3600)
MILLION = Decimal(1_000_000)
WATTS_PER_KILOWATT = Decimal(1000)


def decimal_of(value: float | int | Decimal) -> Decimal:
    """`value` as a Decimal: a float through its shortest repr (2.5, not
    2.5000000000000000001), so a measured 3.3 req/s stays 3.3."""
    if isinstance(value, Decimal):
        return value
    return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)


def _step(currency: str, extra_digits: int = 0) -> Decimal:
    return Decimal(1).scaleb(-(CURRENCY_MINOR_UNITS[currency] + extra_digits))


def amount(value: Decimal, currency: str) -> Decimal:
    """`value` rounded (half up) to the currency's minor unit: 0.01 USD, 1 KRW."""
    return value.quantize(_step(currency), rounding=ROUND_HALF_UP)


def rate(value: Decimal, currency: str) -> Decimal:
    """`value` rounded (half up) to RATE_EXTRA_DIGITS past the minor unit:
    0.000001 USD, 0.0001 KRW."""
    return value.quantize(_step(currency, RATE_EXTRA_DIGITS), rounding=ROUND_HALF_UP)


def rate_places(currency: str) -> int:
    """Decimals a price or a rate may have in `currency`."""
    return CURRENCY_MINOR_UNITS[currency] + RATE_EXTRA_DIGITS


def format_money(value: Decimal | None, currency: str) -> str:
    """In the currency's minor units where that is exact, else with the digits
    the value has: 1234.5 USD is "1,234.50 USD", 4500.0000 KRW "4,500 KRW", a
    rate of 0.003210 USD "0.003210 USD"; "—" for None."""
    if value is None:
        return "—"
    rounded = amount(value, currency)
    return f"{rounded if rounded == value else value:,f} {currency}"


@dataclass(frozen=True)
class Pricing:
    """What one device-hour costs in an environment, and how many devices one
    serving replica holds (None: as many as the load test ran on)."""

    currency: str
    device_hourly_price: Decimal
    power_draw_w: Decimal | None = None
    electricity_price_per_kwh: Decimal | None = None
    devices_per_replica: int | None = None

    @property
    def power_cost_per_device_hour(self) -> Decimal:
        """Electricity of one device for an hour: W / 1000 x price per kWh."""
        if self.power_draw_w is None or self.electricity_price_per_kwh is None:
            return Decimal(0)
        return self.power_draw_w / WATTS_PER_KILOWATT * self.electricity_price_per_kwh

    @property
    def device_hour_cost(self) -> Decimal:
        """Device price plus electricity, per device-hour, unrounded."""
        return self.device_hourly_price + self.power_cost_per_device_hour

    @property
    def priced(self) -> bool:
        """False when a device-hour costs nothing: every cost would read 0, which
        says nothing, so no cost is computed."""
        return self.device_hour_cost > 0

    def replica_devices(self, measured_devices: int) -> int:
        """Devices one replica holds: the cost model's number, else the number the
        load test measured one replica on."""
        return self.devices_per_replica or measured_devices

    def monthly(self, devices: int) -> Decimal:
        """`devices` kept running for a month, as an amount."""
        return amount(devices * self.device_hour_cost * HOURS_PER_MONTH, self.currency)

    def agent_time(self, seconds: float, devices: int = 1) -> Decimal:
        """`seconds` of `devices` devices, as a rate (it is often under a cent)."""
        hours = decimal_of(seconds) / SECONDS_PER_HOUR
        return rate(hours * devices * self.device_hour_cost, self.currency)
