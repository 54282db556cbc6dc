"""Parse the memory budgets users write: bytes, "6GiB"/"512MB", or a fraction of the unplanned peak."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_budget(budget: float | str | None, unplanned_peak: int) -> int:
    """Bytes for `budget`; a float in (0, 1] is a fraction of `unplanned_peak`; None is the peak itself."""
    if budget is None:
        return int(unplanned_peak)
    if isinstance(budget, bool):
        raise TypeError("budget must be bytes, a size string like '6GiB', or a fraction in (0, 1]")
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise ValueError(f"fractional budget {budget} must lie in (0, 1] (a fraction of the unplanned peak "
                             f"{format_bytes(unplanned_peak)})")
        return int(budget * unplanned_peak)
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget {budget} bytes must be positive")
        return budget
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(budget))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read budget {budget!r}: use bytes, '6GiB', '512MB', or a fraction like 0.25")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
