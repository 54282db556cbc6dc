"""bench/compile_time.py: each planner's compile runs in fresh processes, and the median is the figure."""

from __future__ import annotations

import json

import pytest
from turnip.bench import compile_time


def test_the_figure_is_the_median_of_fresh_runs_and_every_run_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TURNIP_RESULTS", str(tmp_path))
    seconds = {"auto": iter([2.5, 1.5, 1.9]), "greedy": iter([1.0, 1.2, 0.8])}
    asked = []

    def run(planner, args):  # stands in for a fresh interpreter's measure()
        asked.append((planner, args.budget, args.time_limit))
        return {"planner_requested": planner, "compile_s": next(seconds[planner]), "cached_compile_s": 0.5,
                "planner": "ilp" if planner == "auto" else "greedy", "outcome": "", "predicted_step_s": 0.02,
                "greedy_predicted_step_s": 0.021, "no_worse_than_greedy": True, "parameters": 30}

    monkeypatch.setattr(compile_time, "measured_in_a_new_process", run)
    assert compile_time.main(["--runs", "3", "--budget", "0.4"]) == 0
    result = json.loads((tmp_path / "compile_time.json").read_text())
    rows = {row["planner_requested"]: row for row in result["rows"]}
    assert rows["auto"]["compile_s"] == 1.9 and rows["auto"]["compile_s_runs"] == [2.5, 1.5, 1.9]
    assert rows["greedy"]["compile_s"] == 1.0
    assert result["meets_target"] == (1.9 <= compile_time.TARGET_S) and result["runs"] == 3
    assert asked == [("auto", 0.4, None)] * 3 + [("greedy", 0.4, None)] * 3


def test_a_run_count_below_one_is_refused():
    with pytest.raises(SystemExit):
        compile_time.main(["--runs", "0"])


def test_one_run_in_its_own_process_prints_its_row(monkeypatch, capsys):
    """--one PLANNER is what each fresh process runs: its row as JSON on the last line."""
    monkeypatch.setattr(compile_time, "measure", lambda planner, budget, options: {"planner_requested": planner,
                                                                                     "budget": budget, **options})
    assert compile_time.main(["--one", "greedy", "--budget", "0.3", "--time-limit", "2"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == \
        {"planner_requested": "greedy", "budget": 0.3, "time_limit": 2.0}
