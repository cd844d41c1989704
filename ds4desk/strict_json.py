"""JSON as untrusted input: no NaN or Infinity, no numbers that overflow to them, no lone
surrogates in any string. `ds4desk session` and `ds4desk serve` read their requests with it, each
wording the refusal in its own protocol."""

from __future__ import annotations

import json
import math
import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


class StrictJsonError(ValueError):
    """`kind`: "constant" (NaN, Infinity), "range" (a number that overflows), "deep" (nesting past
    the parser's recursion limit) or "invalid" (not JSON at all); `detail`: what was wrong."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind, self.detail = kind, detail


def loads(text: str) -> Any:
    def refuse_constant(name: str) -> Any:
        raise StrictJsonError("constant", f"{name} is not a JSON number")

    def finite(number: str) -> float:
        value = float(number)
        if math.isinf(value):
            raise StrictJsonError("range", f"the number {number[:40]} is out of range")
        return value

    try:
        return json.loads(text, parse_constant=refuse_constant, parse_float=finite)
    except StrictJsonError:
        raise
    except RecursionError:
        raise StrictJsonError("deep", "nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and int() of a number with too many digits
        raise StrictJsonError("invalid", str(exc)) from None


def has_lone_surrogate(value: Any) -> bool:
    """A lone surrogate (from an escape like \\ud800, or bytes that were not UTF-8) is no text."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
