"""Ceiling division of non-negative integers: blocks needed for a number of tokens, and the like."""
from __future__ import annotations


def ceil_div(n: int, d: int) -> int:
    """The smallest integer >= n / d, for n >= 0 and d > 0, in integer arithmetic (no float rounding)."""
    return -(-n // d)
