"""python -m turnip.bench table: the newest suite run of each model as one markdown table (bench/table.py),
the table the README shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from turnip.bench.__main__ import main
from turnip.bench.results import RESULTS_DIR
from turnip.bench.table import format_newest, newest_suites

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


def row(model, system, step_ms, peak_gib, budget=None, status="ok"):
    return {"model": model, "system": system, "budget": budget, "status": status,
            "step_s_median": None if step_ms is None else step_ms / 1e3,
            "peak_allocated": None if peak_gib is None else int(peak_gib * GiB)}


def write(path: Path, date: str, rows: list[dict], device="NVIDIA H100 80GB HBM3", device_type="cuda"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": "suite", "device": device, "device_type": device_type, "date": date,
                                "rows": rows}))


@pytest.fixture
def results(tmp_path):
    # gpt's older run sits at the top and sorts after the newer one by name: only the recorded date may decide
    write(tmp_path / "suite_gpt_z.json", "2026-01-01T00:00:00+00:00",
          [row("gpt", "eager", 100.0, 10.0), row("gpt", "turnip", 300.0, 2.0, budget=0.25)])
    write(tmp_path / "h100" / "suite_gpt_a.json", "2026-02-01T00:00:00+00:00",
          [row("gpt", "eager", 200.0, 20.0), row("gpt", "turnip", 250.0, 10.0, budget=0.5),
           row("gpt", "turnip", None, None, budget=0.1, status="timeout"),
           row("gpt", "turnip", 900.0, 4.0, budget=8 * GiB)])
    write(tmp_path / "cpu" / "suite_mlp.json", "2026-01-15T00:00:00+00:00",
          [row("mlp", "turnip", 12.5, 0.5, budget=0.5)], device="x86_64", device_type="cpu")
    return tmp_path


def test_the_newest_run_of_each_model_is_read_at_any_depth(results):
    newest = {model: path.relative_to(results).as_posix() for model, (path, _) in newest_suites(results).items()}
    assert newest == {"gpt": "h100/suite_gpt_a.json", "mlp": "cpu/suite_mlp.json"}


def test_the_table_rows_compare_each_run_with_its_own_eager(results):
    lines = format_newest(results).splitlines()
    caption = lines[0]
    assert "`h100/suite_gpt_a.json` (2026-02-01)" in caption and "`cpu/suite_mlp.json` (2026-01-15)" in caption
    assert "suite_gpt_z" not in caption
    assert lines[1] == ""
    assert lines[2] == "| model | device | system | budget | step ms | peak GiB | vs eager |"
    assert lines[4:] == [
        "| gpt | H100 | eager | - | 200.0 | 20.00 | 1.00x |",
        "| gpt | H100 | turnip | 50% | 250.0 | 10.00 | 1.25x |",
        "| gpt | H100 | turnip | 10% | timeout | - | - |",
        "| gpt | H100 | turnip | 8GiB | 900.0 | 4.00 | 4.50x |",
        "| mlp | cpu | turnip | 50% | 12.5 | 0.50 | - |",  # no eager row in its file: no ratio
    ]


def test_the_command_prints_the_table_and_the_full_tables_on_request(results, capsys):
    assert main(["table", "--out", str(results)]) == 0
    assert capsys.readouterr().out.strip() == format_newest(results)
    assert main(["table", "--out", str(results), "--full"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(format_newest(results)) and "compile s" in out  # then the suite's own tables


def test_the_readme_shows_the_table_of_the_newest_results(monkeypatch):
    """The README's results table is the command's output for the results in the repository: a newer
    suite JSON under bench/results/ means pasting the table again."""
    monkeypatch.chdir(ROOT)
    table = format_newest(RESULTS_DIR)
    assert table.count("\n") > 3, table
    assert table in (ROOT / "README.md").read_text(), "README.md's table is not `python -m turnip.bench table`'s output"
