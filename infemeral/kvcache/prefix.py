"""How many leading tokens two sequences share: what a cache keeps when a new transcript replaces the old one."""

from __future__ import annotations


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
