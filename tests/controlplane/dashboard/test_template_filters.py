import pytest

from controlplane.dashboard.templatetags.dashboard import (
    binary_size,
    percent,
    seconds,
    sig,
)


@pytest.mark.parametrize(
    ("value", "shown"),
    [(0.0132, "13 ms"), (4.24, "4.2 s"), (185, "3 min 05 s"), (7440, "2 h 04 min")],
)
def test_it_words_durations(value, shown):
    assert seconds(value) == shown


@pytest.mark.parametrize(
    ("value", "shown"),
    [(712, "712 bytes"), (4_980_000_000, "4.6 GiB"), (80 * 2**30, "80.0 GiB")],
)
def test_it_words_sizes_in_iec_units(value, shown):
    assert binary_size(value) == shown


def test_it_words_fractions_and_significant_digits():
    assert percent(0.98612) == "98.6%"
    assert sig(292.43076923) == "292.4"
    assert sig(0.00612345) == "0.006123"


@pytest.mark.parametrize("function", [percent, seconds, sig, binary_size])
def test_it_shows_a_dash_for_a_missing_number(function):
    assert function(None) == "—"
    assert function("") == "—"
