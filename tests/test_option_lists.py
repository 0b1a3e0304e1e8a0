"""The one comma-separated list parser behind every list option."""

import pytest

from dsv3.errors import DSV3Error
from dsv3.option_lists import parse_list


def test_items_are_read_in_order_with_blanks_ignored():
    assert parse_list(" 5, 17 ,,42 ", "--ids", int) == [5, 17, 42]
    assert parse_list("fp32,bf16", "--formats") == ["fp32", "bf16"]
    assert parse_list("0,1e3", "--scales", float) == [0.0, 1000.0]


def test_repeats_are_refused_unless_allowed():
    with pytest.raises(DSV3Error, match="--seeds lists a value twice"):
        parse_list("1,1", "--seeds", int)
    assert parse_list("7,7", "--prompt-ids", int, unique=False) == [7, 7]


@pytest.mark.parametrize("text, kind, message", [
    ("", int, "--x is empty"),
    (" , ", int, "--x is empty"),
    ("1,a", int, "--x must be comma-separated integers, got '1,a'"),
    ("0.5,b", float, "--x must be comma-separated numbers"),
])
def test_one_clear_error(text, kind, message):
    with pytest.raises(DSV3Error, match=message):
        parse_list(text, "--x", kind)
