"""Comma-separated list options (``--seeds 0,1,2``, ``--prompt-ids 5,17,42``): one parser, one wording of
its errors, for every command and benchmark that takes such a list."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from dsv3.errors import DSV3Error

T = TypeVar("T")

_NOUNS = {int: "integers", float: "numbers", str: "names"}


def parse_list(text: str, option: str, kind: Callable[[str], T] = str, unique: bool = True) -> list[T]:
    """The items of ``text`` split at commas (blanks around items and empty items ignored), each read by
    ``kind``, in their given order. A :class:`DSV3Error` naming ``option`` when the list is empty, an item
    cannot be read, or (``unique``) an item is given twice."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise DSV3Error(f"{option} is empty")
    try:
        values = [kind(item) for item in items]
    except ValueError:
        noun = _NOUNS.get(kind, "values")  # type: ignore[arg-type]
        raise DSV3Error(f"{option} must be comma-separated {noun}, got {text!r}") from None
    if unique and len(set(values)) != len(values):
        raise DSV3Error(f"{option} lists a value twice: {text!r}")
    return values
