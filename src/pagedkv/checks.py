"""Argument checks: the one place that says what a valid int, number or flag argument is.

Every public call in pagedkv validates its arguments before it changes anything (docs/design.md
section 3.9), and they all mean the same thing by "an int": a Python int or a numpy integer,
never a bool (``True`` is an int to Python, but ``block_size=True`` is a bug) and never a float
(``2.0`` blocks is a unit mistake more often than not). This module imports nothing from pagedkv,
so every layer, the allocator's lowest included, may use it.

Worked example: ``int_at_least("block_size", np.int64(16), 1)`` returns the Python int 16;
``int_at_least("block_size", True, 1)`` raises ``ValueError: block_size must be an int >= 1,
got True``.
"""
from __future__ import annotations

import math
import operator
from typing import Any

__all__ = ["as_int", "int_at_least", "optional_int_at_least", "number_at_least", "flag", "require"]


def as_int(value: Any, what: str) -> int:
    """``value`` as a Python int (numpy integers welcome); ValueError for bools and non-integers."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or isinstance(value, float) or type(value).__name__ == "bool_":
        raise ValueError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an int, got {type(value).__name__}") from None


def int_at_least(name: str, value: Any, lo: int = 0, *, expected: str | None = None) -> int:
    """An int argument no smaller than ``lo``, returned as a Python int.

    ``expected`` rewords what the error says the value must be, for messages users already match
    on (``expected="a positive int"``: ``block_size must be a positive int, got 0``); the rule
    itself never changes."""
    if type(value) is not int:
        if isinstance(value, bool) or not hasattr(value, "__index__") or type(value).__name__ == "bool_":
            raise ValueError(f"{name} must be {expected or f'an int >= {lo}'}, got {value!r}")
        value = operator.index(value)
    if value < lo:
        raise ValueError(f"{name} must be {expected or f'an int >= {lo}'}, got {value!r}")
    return value


def optional_int_at_least(name: str, value: Any, lo: int = 0, *, expected: str | None = None) -> int | None:
    """``None`` (meaning "no limit" or "the default"), or an int no smaller than ``lo``; the error
    names both choices: ``optional_int_at_least("data_parallel_rank", -1)`` raises
    ``ValueError: data_parallel_rank must be None or an int >= 0, got -1``."""
    if value is None:
        return None
    return int_at_least(name, value, lo, expected=expected or f"None or an int >= {lo}")


def number_at_least(name: str, value: Any, lo: float = 0.0, *, strict: bool = False,
                    expected: str | None = None) -> float:
    """A finite real number (int or float, numpy scalars welcome, bools refused) that is ``>= lo``,
    or ``> lo`` when ``strict``; returned as a float. ``expected`` as for :func:`int_at_least`."""
    ok = not isinstance(value, bool) and type(value).__name__ != "bool_"
    try:
        number = float(value) if ok and hasattr(value, "__float__") and not isinstance(value, str) else None
    except (TypeError, ValueError):
        number = None
    bound = ">" if strict else ">="
    if number is None or not math.isfinite(number) or number < lo or (strict and number == lo):
        raise ValueError(f"{name} must be {expected or f'a finite number {bound} {lo:g}'}, got {value!r}")
    return number


def flag(name: str, value: Any) -> bool:
    """A bool argument: exactly ``True`` or ``False`` (``1`` or ``"yes"`` are refused, since a
    truthy string would silently switch a feature on)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def require(cond: bool, msg: str) -> None:
    """An invariant check (``check_invariants`` and friends): AssertionError when ``cond`` fails.
    Unlike ``assert`` it also runs under ``python -O``."""
    if not cond:
        raise AssertionError(msg)
