"""The cost model's schema: prices as Decimal in a currency, refused by name when
they can't mean what they say."""

from decimal import Decimal

import pytest
from pydantic import ValidationError

from controlplane.costs.spec import CostModel


def error_at(body: dict) -> tuple[str, str]:
    with pytest.raises(ValidationError) as caught:
        CostModel.model_validate(body)
    first = caught.value.errors()[0]
    return ".".join(str(p) for p in first["loc"]), first["msg"]


def test_it_takes_prices_as_decimal_strings_or_json_numbers():
    model = CostModel.model_validate(
        {
            "currency": "KRW",
            "device_hourly_price": "4500",
            "power_draw_w": 700,
            "electricity_price_per_kwh": 120.5,
        }
    )

    assert model.device_hourly_price == Decimal("4500")
    assert model.electricity_price_per_kwh == Decimal("120.5")  # not 120.499999...
    assert model.model_dump(mode="json")["electricity_price_per_kwh"] == "120.5"
    assert CostModel.model_validate({"device_hourly_price": 0.1}).pricing.priced


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"device_hourly_price": True}, "device_hourly_price", "not a boolean"),
        ({"device_hourly_price": "2,50"}, "device_hourly_price", "not a decimal"),
        ({"device_hourly_price": "NaN"}, "device_hourly_price", "finite"),
        ({"device_hourly_price": "-1"}, "device_hourly_price", "greater than"),
        (
            {"currency": "KRW", "device_hourly_price": "4500.00001"},
            "device_hourly_price",
            "at most 4 decimals in KRW",
        ),
        (
            {"device_hourly_price": "2.0000001"},
            "device_hourly_price",
            "at most 6 decimals in USD",
        ),
        ({"power_draw_w": "700"}, "electricity_price_per_kwh", "come together"),
        ({"currency": "GBP"}, "currency", "USD"),
        ({"target_requests_per_s": {"chat": 0}}, "target_requests_per_s.chat", "above"),
        ({"target_requests_per_s": {"chat": "5"}}, "target_requests_per_s.chat", ""),
        ({"devices_per_replica": 1.0}, "devices_per_replica", ""),
        ({"price": "2.50"}, "price", "Extra inputs"),
    ],
)
def test_it_names_what_is_wrong(body, field, message):
    where, why = error_at(body)

    assert where == field
    assert message in why
