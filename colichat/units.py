"""Sizes and counts as every message shows them: binary units (B, KiB, MiB, GiB; 1 MiB = 1,048,576
bytes), and '1 exchange', '2 exchanges'."""

from __future__ import annotations


def format_size(n: float) -> str:
    """'812 B', '45.0 KiB', '3.0 MiB', '5.2 GiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{int(n)} B"


def count(n: int, noun: str) -> str:
    """'1 exchange', '0 exchanges', '2 exchanges'."""
    return f"{n} {noun}" + ("" if n == 1 else "s")
