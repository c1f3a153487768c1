"""An environment's cost model (a pydantic schema, validated strictly like the gate
policy): what a device-hour costs there, in which currency, how many devices one
serving replica holds, and the traffic to plan capacity for.

Prices are Decimal, given as a decimal string ("2.49") or a JSON number (taken by its
shortest repr: 0.1 is 0.1), never a boolean; at most the currency's minor units plus
money.RATE_EXTRA_DIGITS decimals (cloud prices are quoted to fractions of a cent).
They are written back as decimal strings. Power draw and electricity price come as a
pair: one without the other can't be priced.
"""

from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    model_validator,
)

from controlplane.costs.money import CURRENCIES, Pricing, rate_places
from controlplane.releases.gates import WorkloadName, field_error

MAX_PRICE = Decimal(10**9)


def _decimal(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError('must be a decimal number such as "2.50", not a boolean')
    if isinstance(value, float):
        value = repr(value)
    if isinstance(value, int):
        return Decimal(value)
    if isinstance(value, str):
        try:
            number = Decimal(value)
        except InvalidOperation:
            raise ValueError(
                f'{value!r} is not a decimal number such as "2.50"'
            ) from None
        if not number.is_finite():
            raise ValueError("must be a finite number")
        return number
    if isinstance(value, Decimal):
        return value
    raise ValueError('must be a decimal number such as "2.50"')


Price = Annotated[
    Decimal,
    BeforeValidator(_decimal),
    Field(ge=0, le=MAX_PRICE),
    # What a client may send (and reads back: a string), in plain JSON Schema.
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "minimum": 0, "maximum": int(MAX_PRICE)},
                {"type": "string", "pattern": r"^[0-9]{1,10}(\.[0-9]{1,6})?$"},
            ]
        }
    ),
]
PRICE_FIELDS = ("device_hourly_price", "electricity_price_per_kwh")
Currency = Literal[CURRENCIES]  # type: ignore[valid-type]


class CostModel(BaseModel):
    """What an environment's devices cost. The default (nothing set) prices a
    device-hour at 0 USD: no cost is computed from it, and the pages say so."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    currency: Currency = Field("USD", description="ISO 4217: " + ", ".join(CURRENCIES))
    device_hourly_price: Price = Field(
        Decimal(0), description="one device for one hour, in `currency`"
    )
    power_draw_w: Price | None = Field(
        None, description="mean draw of one device under load, in watts"
    )
    electricity_price_per_kwh: Price | None = Field(
        None, description="in `currency` per kWh; with power_draw_w"
    )
    devices_per_replica: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="devices one serving replica holds (null: as many as the "
        "load test ran on)",
    )
    target_requests_per_s: dict[WorkloadName, float | None] = Field(
        default_factory=dict,
        description="traffic to plan capacity for: requests/s per workload (null "
        "removes a workload's target, as a PATCH merges this map key by key)",
    )
    note: str = Field(
        "",
        max_length=200,
        pattern=r"^[^\x00-\x1f\x7f]*$",
        description='where the price comes from, e.g. "example price"',
    )

    @model_validator(mode="after")
    def _check(self) -> "CostModel":
        places = rate_places(self.currency)
        step = Decimal(1).scaleb(-places)
        for name in PRICE_FIELDS:
            value = getattr(self, name)
            if value is not None and value != value.quantize(step):
                raise field_error(
                    name,
                    f"at most {places} decimals in {self.currency}",
                    str(value),
                )
        if (self.power_draw_w is None) != (self.electricity_price_per_kwh is None):
            missing = (
                "electricity_price_per_kwh"
                if self.power_draw_w is not None
                else "power_draw_w"
            )
            raise field_error(
                missing,
                "power_draw_w and electricity_price_per_kwh come together: "
                "one without the other can't be priced",
                None,
            )
        self.target_requests_per_s = {
            name: requests_per_s
            for name, requests_per_s in self.target_requests_per_s.items()
            if requests_per_s is not None
        }
        for name, requests_per_s in self.target_requests_per_s.items():
            if not 0 < requests_per_s <= 1e9:
                raise field_error(
                    f"target_requests_per_s.{name}",
                    "must be a rate above 0 requests/s",
                    requests_per_s,
                )
        return self

    @property
    def pricing(self) -> Pricing:
        return Pricing(
            currency=self.currency,
            device_hourly_price=self.device_hourly_price,
            power_draw_w=self.power_draw_w,
            electricity_price_per_kwh=self.electricity_price_per_kwh,
            devices_per_replica=self.devices_per_replica,
        )
