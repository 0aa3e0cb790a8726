"""The ``check`` helper and the small validators every config part (and the sampling
parameters, the scheduler and the router) use, so that a bad value reads the same everywhere:
``<name>=<value!r> is invalid; allowed: <allowed>``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any, TypeVar

T = TypeVar("T")


def check(ok: bool, name: str, value: Any, allowed: str) -> None:
    """Raise ``ValueError('<name>=<value!r> is invalid; allowed: <allowed>')`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid; allowed: {allowed}")


def is_number(value: Any) -> bool:
    """True for an int or float that is not a bool (``True`` is not a number of GiB)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: Any, minimum: int = 1, optional: bool = False) -> None:
    """Check that ``value`` is an int (not bool) >= ``minimum`` (or None when ``optional``)."""
    if optional and value is None:
        return
    check(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        name,
        value,
        f"an integer >= {minimum}" + (" or null" if optional else ""),
    )


def unknown_key_error(kind: str, key: str, valid: list[str]) -> ValueError:
    """A ``ValueError`` for an unknown key, listing the close matches (or all valid keys)."""
    close = difflib.get_close_matches(key, valid, n=3)
    hint = (
        f"did you mean {', '.join(close)}?" if close else f"valid keys: {', '.join(sorted(valid))}"
    )
    return ValueError(f"unknown {kind} {key!r}; {hint}")


def config_from_value(cls: type[T], value: T | dict | str | None, name: str) -> T:
    """A config dataclass ``cls`` from a JSON object string (a CLI flag), a dict, ``None``
    (its defaults) or an instance (returned as is); ``name`` is the flag's name in errors.

    Raises:
        ValueError: bad JSON, not an object, an unknown key (with close matches), or what
            ``cls`` raises for a bad field value.
    """
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON ({e}): {value!r}") from None
    check(isinstance(value, dict), name, value, "a JSON object or dict")
    names = [f.name for f in dataclasses.fields(cls)]
    for key in value:
        if key not in names:
            raise unknown_key_error(f"{name} key", key, names)
    return cls(**value)
