"""Pydantic's lax-mode coercions, as vLLM's request models apply them to a JSON body. Pure.

vLLM validates requests with pydantic models in lax mode, so `"stream": 1`, `"stream": "true"` and
`"max_tokens": 16.0` are requests it serves (AIBrix's benchmark client sends `"stream": 1`). The gateway
and engine-sim read the same fields, so they accept exactly these forms and refuse the rest with the
message pydantic gives. Strings are never coerced from other types (pydantic v2 does not either).
"""

from __future__ import annotations

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
_INT_LIMIT = 2**63  # pydantic refuses floats past i64 ("exceeded maximum size")


class LaxError(ValueError):
    """The value is not one lax mode coerces to the field's type; the message is pydantic's."""


def as_bool(value: object) -> bool:
    """bool; the integers 0/1; the floats 0.0/1.0; the strings pydantic reads as booleans."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        if value in (0, 1):
            return value == 1
        if isinstance(value, int):
            raise LaxError("Input should be a valid boolean, unable to interpret input")
        raise LaxError("Input should be a valid boolean")
    if isinstance(value, str):
        lowered = value.lower()
        if lowered in _TRUE or lowered in _FALSE:
            return lowered in _TRUE
        raise LaxError("Input should be a valid boolean, unable to interpret input")
    raise LaxError("Input should be a valid boolean")


def as_int(value: object) -> int:
    """int; a bool as 0/1; a float with no fraction; a string holding an integer (surrounding space,
    a sign and `_` separators allowed, as Python's int() reads it) or a decimal with no fraction."""
    if isinstance(value, int):  # bool included: pydantic's lax int takes True as 1
        return int(value)
    if isinstance(value, float):
        return _whole(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
        try:
            number = float(value)
        except ValueError:
            raise LaxError("Input should be a valid integer, unable to parse string as an integer") from None
        if "e" in value.lower() or value.strip().lower() in ("inf", "-inf", "+inf", "nan", "infinity"):
            raise LaxError("Input should be a valid integer, unable to parse string as an integer")
        return _whole(number)
    raise LaxError("Input should be a valid integer")


def _whole(number: float) -> int:
    if number != number or abs(number) >= _INT_LIMIT:
        raise LaxError("Input should be a finite number")
    if not number.is_integer():
        raise LaxError("Input should be a valid integer, got a number with a fractional part")
    return int(number)
