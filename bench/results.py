"""Where benchmark JSON goes, and the facts every result file carries (device, versions, commit)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import subprocess
from collections import defaultdict
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def result_path(name: str) -> Path:
    """bench/results/<name> (or $TURNIP_RESULTS/<name>), its folder created."""
    folder = Path(os.environ.get("TURNIP_RESULTS", RESULTS_DIR))
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def write_result(name: str, doc: dict) -> Path:
    """Write ``doc`` as JSON to result_path(name) and say where; the path."""
    path = result_path(name)
    path.write_text(json.dumps(doc, indent=1, default=str))
    logging.getLogger(__name__).info("results in %s", path)
    return path


def _commit() -> str:
    """$TURNIP_COMMIT when set (a snapshot copied to the GPU machine has no history of its own),
    else HEAD of the git checkout this package lives in; "unknown" when the package is not the
    top of a checkout (an exported snapshot inside another repository would report that one's)."""
    if os.environ.get("TURNIP_COMMIT"):
        return os.environ["TURNIP_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, cwd=root,
                             timeout=10, check=False).stdout.strip()
        if not top or Path(top).resolve() != root:
            return "unknown"
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=root, timeout=10, check=False).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_metadata() -> dict:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
    }


def load_suite_rows(folder: str | Path) -> dict[str, list[dict]]:
    """Rows of every suite_*.json in ``folder`` by model; a later run's row (by the date its file
    records, not the file's mtime, which a git checkout resets) replaces an earlier one's for the same
    (system, budget), so results split over several commands merge. Each row says which file it came
    from (``source``), so it can still be compared with the eager row of its own run."""
    by_model: dict[str, dict] = defaultdict(dict)
    docs = [(json.loads(file.read_text()), file) for file in Path(folder).glob("suite_*.json")]
    for doc, file in sorted(docs, key=lambda d: (str(d[0].get("date") or ""), d[1].name)):
        for row in doc.get("rows", []):
            by_model[row["model"]][(row["system"], row.get("budget"))] = {**row, "source": file.name}
    return {model: list(rows.values()) for model, rows in by_model.items()}
