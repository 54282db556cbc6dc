"""The README's results table: the newest suite run of each model, as one markdown table.

    python -m turnip.bench table                  # bench/results/ and every folder under it
    python -m turnip.bench table --results DIR    # DIR instead (then DIR's full tables, see __main__)

For each model, the suite JSON (``suite_*.json`` at any depth) whose recorded ``date`` is the newest
is read (a file with no date counts as the oldest; a tie goes to the later path), and each of its
rows becomes one line: model, device, system, budget, step time (the median of the timed steps, or
the row's status when it has none), measured peak GPU memory, and the step time as a multiple of
the eager row of the same file. A one-line caption above the table names the files read and
their dates, so a pasted table says where it came from.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from ..ir.budget import format_bytes

HEADER = ("model", "device", "system", "budget", "step ms", "peak GiB", "vs eager")


def _date(doc: dict) -> str:
    return str(doc.get("date") or "")


def newest_suites(folder: str | Path) -> dict[str, tuple[Path, dict]]:
    """model -> (file, its JSON) of the newest suite run of that model under ``folder``, at any depth."""
    newest: dict[str, tuple[Path, dict]] = {}
    for path in sorted(Path(folder).rglob("suite_*.json")):
        doc = json.loads(path.read_text())
        models = {row["model"] for row in doc.get("rows", []) if "model" in row}
        for model in models:
            if model not in newest or (_date(doc), str(path)) >= (_date(newest[model][1]), str(newest[model][0])):
                newest[model] = (path, doc)
    return newest


def device_label(doc: dict) -> str:
    """"H100" for "NVIDIA H100 80GB HBM3", "cpu" for a CPU run, "-" when the file does not say."""
    if doc.get("device_type") == "cpu":
        return "cpu"
    words = str(doc.get("device") or "").replace("NVIDIA", "").split()
    return words[0] if words else "-"


def budget_cell(budget) -> str:
    """A fraction of eager's measured peak as a percentage ("25%"), a size in binary units ("16GiB")."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        return "-"
    if isinstance(budget, int):
        return format_bytes(budget, compact=True)
    return f"{100 * budget:.3g}%"


def _number(x) -> float | None:
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    return float(x) if ok else None


def table_rows(doc: dict) -> list[tuple[str, ...]]:
    """One line per row of a suite JSON, compared with that file's eager row."""
    rows = doc.get("rows", [])
    eager = next((_number(r.get("step_s_median")) for r in rows
                  if r.get("system") == "eager" and r.get("status") == "ok"), None)
    lines = []
    for r in rows:
        step = _number(r.get("step_s_median")) if r.get("status") == "ok" else None
        peak = _number(r.get("peak_allocated"))
        lines.append((
            str(r.get("model", "-")), device_label(doc), str(r.get("system", "-")), budget_cell(r.get("budget")),
            f"{step * 1e3:.1f}" if step is not None else str(r.get("status") or "-"),
            f"{peak / 2**30:.2f}" if peak is not None and step is not None else "-",
            f"{step / eager:.2f}x" if step is not None and eager else "-"))
    return lines


def _shown(path: Path) -> str:
    """A path as the caption names it: relative to the working directory when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def format_newest(folder: str | Path) -> str:
    """The caption and the markdown table of the newest suite run of every model under ``folder``."""
    folder = Path(folder)
    newest = newest_suites(folder)
    if not newest:
        return f"No suite_*.json under {_shown(folder)}."
    read = ", ".join(f"`{os.path.relpath(path, folder)}` ({_date(doc)[:10] or 'undated'})"
                     for _, (path, doc) in sorted(newest.items()))
    lines = [f"The newest suite run of each model under `{_shown(folder)}/`: {read}.", "",
             "| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    for model in sorted(newest):
        lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(newest[model][1])]
    return "\n".join(lines)
