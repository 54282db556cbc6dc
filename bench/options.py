"""Command-line options the benchmarks share."""

from __future__ import annotations

import json


def planner_options(items: list[str]) -> dict:
    """``--planner-option KEY=VALUE`` items as compile's keyword arguments, each value read as JSON
    when it parses (``time_limit=8`` is a number, ``reload_room=true`` a bool), else kept as text."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--planner-option takes KEY=VALUE, not {item!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def budget_arg(text: str) -> float | int:
    """``--budget``: a fraction (0.5) or bytes (an int), as memgraph.compile takes them."""
    number = float(text)
    return int(number) if number > 1 and number.is_integer() else number
