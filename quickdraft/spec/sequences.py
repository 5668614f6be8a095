"""Token sequences compared: one rule for every place that asks how far two agree."""
from __future__ import annotations

from typing import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
