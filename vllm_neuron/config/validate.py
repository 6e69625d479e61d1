"""The checks engine options share: integers and numbers in a range, booleans, TCP ports, host names, one
of a list, and the refusal of what is not built yet (pure).

Every check raises a ValueError that names the option and what is valid, and returns the value (numbers
given as text are converted only where `from_text` says so: neuron_config, whose documented examples
quote them, "0.7"). A bool is never taken for an integer.
"""
from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any, TypeVar

T = TypeVar("T")


def _integer_range(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an integer in [{minimum}, {maximum}]"
    if minimum == 1:
        return "a positive integer"
    if minimum == 0:
        return "a non-negative integer"
    if minimum is not None:
        return f"an integer >= {minimum}"
    if maximum is not None:
        return f"an integer <= {maximum}"
    return "an integer"


def integer(option: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
            from_text: bool = False, context: str = "") -> int:
    """`value` as an int within [minimum, maximum]; `context` (e.g. "nnodes=2") explains a bound."""
    if from_text and isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int) or \
            (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        where = f" ({context})" if context else ""
        raise ValueError(f"{option} must be {_integer_range(minimum, maximum)}{where}, got {value!r}")
    return value


def optional_integer(option: str, value: Any, **bounds: Any) -> int | None:
    """None (unset) or integer(option, value, **bounds)."""
    return None if value is None else integer(option, value, **bounds)


def number(option: str, value: Any, *, minimum: float | None = None, maximum: float | None = None,
           min_exclusive: bool = False, from_text: bool = False) -> float:
    """`value` as a finite float within the bounds (`min_exclusive`: the minimum itself is refused)."""
    if from_text and isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{option} must be a number, got {value!r}")
    low_ok = minimum is None or (value > minimum if min_exclusive else value >= minimum)
    if not low_ok or (maximum is not None and value > maximum):
        if minimum is not None and maximum is not None:
            bound = f"in {'(' if min_exclusive else '['}{minimum:g}, {maximum:g}]"
        elif minimum is not None:
            bound = f"{'>' if min_exclusive else '>='} {minimum:g}"
        else:
            bound = f"<= {maximum:g}"
        raise ValueError(f"{option} must be {bound}, got {value:g}")
    return float(value)


def boolean(option: str, value: Any, *, allow_none: bool = False) -> bool | None:
    """True or False (None too with allow_none: a tri-state option left unset)."""
    if isinstance(value, bool) or (allow_none and value is None):
        return value
    valid = "true, false or unset" if allow_none else "true or false"
    raise ValueError(f"{option} must be {valid}, got {value!r}")


def choice(option: str, value: T, choices: Collection[T]) -> T:
    if value not in choices:
        raise ValueError(f"{option}={value!r} is not valid; valid values: {list(choices)}")
    return value


def port(option: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ValueError(f"{option} must be a TCP port in [1, 65535], got {value!r}")
    return value


def host(option: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{option} must be a host name or IP address, got {value!r}")
    return value


def not_supported(option: str, value: Any, hint: str = "") -> ValueError:
    """The error for an option we parse but do not build yet (raise it)."""
    return ValueError(f"{option}={value!r} is not supported yet by vllm-neuron{': ' + hint if hint else ''}")
