"""The ``check`` helper and the small validators every config part (and the sampling
parameters, the scheduler and the router) use, so that a bad value reads the same everywhere:
``<name>=<value!r> is invalid; allowed: <allowed>``.
"""

from __future__ import annotations

import difflib
from typing import Any


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
