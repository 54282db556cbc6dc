"""Memory budgets as users write them, and byte formatting.

One meaning everywhere (memgraph.compile, the demo, the CLI):

- a fraction of the unplanned peak (the GPU bytes the step takes with everything kept): a float
  in (0, 1] such as ``0.5``, or a percentage string such as ``"50%"``;
- a size: a string with a unit (``"6GiB"``, ``"512MiB"``, ``"1.5GB"``) or an int of bytes.
  An int below 1 MiB is refused: ``budget=1`` is far more likely a fraction written as an int
  than a one-byte GPU.

A plain number in a string reads like the number itself (``"0.5"`` is a fraction, ``"6000000000"``
bytes), so command lines can pass budgets through unchanged.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re

MIN_INT_BYTES = 1 << 20  # ints below this are refused: almost surely a fraction written as an int

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_FORMS = ("a fraction of the unplanned peak in (0, 1] such as 0.5 or '50%', "
          "or a size such as '6GiB', '512MiB' or an int of bytes (at least 1 MiB)")
_NUMBER = r"[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?"


class BudgetError(ValueError):
    """A budget that cannot be read; the message says what was given and what is accepted."""


@dataclasses.dataclass(frozen=True)
class Budget:
    """A budget read once (``Budget.read``), in the form it was given: ``fraction`` of the unplanned
    peak, or ``size`` in bytes (at most one is set: neither for ``Budget.read(None)``, the whole peak). Its
    bytes depend on the unplanned peak only for a fraction: ``budget.bytes(peak)``."""

    fraction: float | None = None
    size: int | None = None
    given: str = "None"  # as the user wrote it, for messages
    what: str = "budget"

    @classmethod
    def read(cls, budget: float | str | Budget | None, what: str = "budget",
             unplanned_peak: int | None = None) -> Budget:
        """The budget in one of the module docstring's forms; raises BudgetError (a ValueError) for
        anything else, naming the argument (``what``), what was given and the accepted forms;
        ``unplanned_peak``, when known, is named in the error of a fraction out of range."""
        if budget is None:
            return cls(what=what)
        if isinstance(budget, Budget):
            return budget
        if isinstance(budget, bool) or not isinstance(budget, (numbers.Real, str)):
            raise BudgetError(f"{what}={budget!r} ({type(budget).__name__}) is not a budget: use {_FORMS}")
        given = repr(budget)
        if isinstance(budget, numbers.Integral):
            return cls(size=_bytes(int(budget), what, given), given=given, what=what)
        if isinstance(budget, numbers.Real):
            return cls(fraction=_fraction(float(budget), unplanned_peak, what, given), given=given, what=what)
        return _parse_text(budget, unplanned_peak, what)

    def bytes(self, unplanned_peak: int | None) -> int:
        """The budget in bytes, a fraction taken of ``unplanned_peak`` (at least one byte)."""
        if self.size is not None:
            return self.size
        if self.fraction is None:  # no budget: the whole peak
            return int(unplanned_peak or 0)
        return max(1, int(self.fraction * (unplanned_peak or 0)))


def parse_budget(budget: float | str | None, unplanned_peak: int | None, what: str = "budget") -> int:
    """Bytes for `budget` (see the module docstring for the forms); None is the unplanned peak.
    ``Budget.read(budget, what).bytes(unplanned_peak)``, for callers that hold no Budget."""
    return Budget.read(budget, what, unplanned_peak).bytes(unplanned_peak)


def _parse_text(text: str, unplanned_peak: int | None, what: str) -> Budget:
    given = repr(text)
    match = re.fullmatch(rf"\s*({_NUMBER})\s*(%|[a-zA-Z]*)\s*", text)
    if not match:
        raise BudgetError(f"cannot read {what}={given}: use {_FORMS}")
    number, unit = match.group(1), match.group(2).lower()
    if unit == "%":
        return Budget(fraction=_fraction(float(number) / 100, unplanned_peak, what, given), given=given, what=what)
    if unit == "":  # a bare number reads like the Python number it spells
        if re.fullmatch(r"[0-9]+", number):
            return Budget(size=_bytes(int(number), what, given), given=given, what=what)
        return Budget(fraction=_fraction(float(number), unplanned_peak, what, given), given=given, what=what)
    if unit not in _UNITS:
        raise BudgetError(f"cannot read {what}={given}: unknown unit {match.group(2)!r} "
                          f"(use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)")
    nbytes = float(number) * _UNITS[unit]
    if not nbytes >= 1:
        raise BudgetError(f"{what}={given} is {nbytes:g} bytes: a budget must be at least one byte")
    return Budget(size=int(nbytes), given=given, what=what)


def _bytes(nbytes: int, what: str, given: str) -> int:
    if nbytes <= 0:
        raise BudgetError(f"{what}={given} must be positive: use {_FORMS}")
    if nbytes < MIN_INT_BYTES:
        raise BudgetError(f"{what}={given} would be {nbytes} bytes ({format_bytes(nbytes)}): did you mean a "
                          f"fraction? Write {what}=0.5 or '50%' for half the unplanned peak; for a size this "
                          f"small, give a unit, e.g. '{format_bytes(nbytes, compact=True)}'")
    return nbytes


def _fraction(fraction: float, unplanned_peak: int | None, what: str, given: str) -> float:
    if not math.isfinite(fraction) or not 0 < fraction <= 1:
        hint = (" (a size needs a unit, e.g. '6GiB', or an int of bytes)" if math.isfinite(fraction) and fraction > 1
                else "")
        peak = f" ({format_bytes(unplanned_peak)})" if unplanned_peak else ""
        raise BudgetError(f"{what}={given} is read as a fraction of the unplanned peak{peak} and must lie in "
                          f"(0, 1]{hint}")
    return fraction


def budget_size(budget: float | str | None) -> int | None:
    """The bytes of a budget given as a size; None for a fraction of the unplanned peak (or None),
    whose bytes depend on the peak."""
    return Budget.read(budget).size


def check_budget(budget: float | str | None, what: str = "budget") -> None:
    """Raise the BudgetError Budget.read would, before the unplanned peak is known."""
    Budget.read(budget, what)


def budget_fields(gpu_budget: int | None, unplanned_peak: int | None) -> dict:
    """The budget as a summary reports it: bytes, and the fraction of the unplanned peak (None when
    either is unknown)."""
    fraction = gpu_budget / unplanned_peak if gpu_budget is not None and unplanned_peak else None
    return {"budget_bytes": gpu_budget, "unplanned_peak": unplanned_peak, "budget_fraction": fraction}


def format_bytes(n: int, compact: bool = False) -> str:
    """1536 -> '1.50 KiB'; compact: '1.5KiB', a form parse_budget reads back."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:g}{unit}" if compact else f"{n / scale:.2f} {unit}"
    return f"{n}B" if compact else f"{n} B"
