"""bench/soak.py: the growth and drift checks on synthetic series (a flat run passes, a planted growth
or drift fails, naming the bound), the readings, and one short soak of the tiny GPT on the CPU through
`python -m turnip.bench soak`, which writes its JSON whatever the verdict."""

from __future__ import annotations

import json
import math

import pytest
from turnip.bench import soak
from turnip.bench.__main__ import main as bench_main

N = 200
GiB = 1 << 30


def flat(n: int = N) -> dict[str, list]:
    """A healthy run: memory constant from step 3 on (the first steps allocate), step times alternating
    within 1% of 100 ms."""
    grow = [0.5, 0.8] + [1.0] * (n - 2)
    return {"step_s": [0.100 + 0.001 * (i % 2) for i in range(n)], "loss": [10.0 - i * 1e-3 for i in range(n)],
            "host_rss_bytes": [int(3 * GiB * g) for g in grow], "pinned_bytes": [5 * GiB] * n,
            "pinned_storage_bytes": [5 * GiB] * n, "pinned_allocator_bytes": [0] * n,
            "gpu_allocated_bytes": [int(4 * GiB * g) for g in grow], "gpu_reserved_bytes": [int(5 * GiB * g) for g in grow]}


def test_a_flat_run_passes_every_check():
    summary = soak.summarize(flat())
    assert summary["ok"] and summary["failures"] == []
    assert {c["check"] for c in summary["checks"]} == {
        "host RSS growth", "pinned host bytes growth", "GPU allocated growth", "GPU reserved growth", "step time drift"}
    assert summary["host_rss"] == {"at_base_step": 3 * GiB, "at_end": 3 * GiB, "max": 3 * GiB, "growth": 0.0}
    # steps 10..29 against the last 20 (1-based, inclusive)
    assert summary["step_s"]["first_window_steps"] == [10, 29] and summary["step_s"]["last_window_steps"] == [181, 200]
    assert abs(summary["step_s"]["drift"]) < 0.01


@pytest.mark.parametrize("key", list(soak.MEMORY))
def test_a_memory_growing_after_step_10_fails_naming_it(key):
    series = flat()
    base = series[key][soak.BASE_STEP - 1]
    step = base // 10_000 or 4096  # 190 steps of 0.01% (from nothing: 4 KiB): 1.9%, above the 1% bound
    series[key] = series[key][:soak.BASE_STEP] + [base + step * k for k in range(1, N - soak.BASE_STEP + 1)]
    summary = soak.summarize(series)
    growth = step * (N - soak.BASE_STEP) / base if base else math.inf
    assert summary[key.removesuffix("_bytes")]["growth"] == pytest.approx(growth)
    assert not summary["ok"]
    assert [c["check"] for c in summary["checks"] if not c["ok"]] == [f"{soak.MEMORY[key]} growth"]
    assert len(summary["failures"]) == 1 and soak.MEMORY[key] in summary["failures"][0]
    assert "--memory-bound" in summary["failures"][0]


def test_a_leak_of_a_hundred_kib_a_step_breaks_the_one_percent_bound_on_a_large_process():
    series = flat()
    series["gpu_reserved_bytes"] = [5 * GiB + 100 * 1024 * k for k in range(N)]  # +19 MiB over 190 steps: 0.37%
    assert soak.summarize(series)["ok"]
    series["gpu_reserved_bytes"] = [5 * GiB + 1024 * 1024 * k for k in range(N)]  # +190 MiB from 5.01 GiB: 3.7%
    summary = soak.summarize(series)
    assert not summary["ok"] and "GPU reserved grew +3.70%" in summary["failures"][0]
    assert soak.summarize(series, soak.Bounds(memory=0.05))["ok"]  # the bound is the caller's


def test_growth_from_nothing_fails_and_shrinking_passes():
    series = flat()
    series["pinned_bytes"] = [0] * (N - 1) + [4096]
    summary = soak.summarize(series)
    assert summary["pinned"]["growth"] == math.inf and not summary["ok"]
    series = flat()
    series["host_rss_bytes"] = [3 * GiB - 1024 * k for k in range(N)]  # memory handed back: not a leak
    assert soak.summarize(series)["ok"]


@pytest.mark.parametrize("late, ok", [(0.109, True), (0.115, False), (0.085, False), (0.092, True)])
def test_step_time_drift_is_bounded_either_way(late, ok):
    series = flat()
    series["step_s"] = [0.100] * (N - 20) + [late] * 20
    summary = soak.summarize(series)
    assert summary["step_s"]["drift"] == pytest.approx(late / 0.100 - 1)
    assert summary["ok"] is ok
    if not ok:
        assert "step time drifted" in summary["failures"][0] and "--drift-bound" in summary["failures"][0]


def test_a_non_finite_loss_fails():
    series = flat()
    series["loss"][50] = math.nan
    summary = soak.summarize(series)
    assert not summary["ok"] and summary["failures"] == ["non-finite loss from step 51"]


def test_too_few_steps_are_refused():
    assert not soak.summarize(flat(12))["ok"]
    with pytest.raises(SystemExit, match="20 steps at least"):
        soak.config_from(soak.parser().parse_args(["--tiny", "--steps", "12"]))


def test_readings_on_the_cpu(monkeypatch):
    rss = soak.host_rss()
    assert rss > 10 << 20
    monkeypatch.setattr(soak, "psutil", None)  # the fallback: /proc/self/statm
    assert soak.rss_source() == "/proc/self/statm"
    assert soak.host_rss() == pytest.approx(rss, rel=0.2)
    reading = soak.readings(None, "cpu")
    assert reading["pinned_bytes"] == reading["gpu_reserved_bytes"] == reading["gpu_allocated_bytes"] == 0


def test_a_short_cpu_soak_writes_its_json_and_fails_on_a_broken_bound(tmp_path, capsys):
    # a drift bound of 0: no two windows of real step times have the same median, so the command must fail
    argv = ["soak", "--tiny", "--steps", "20", "--budgets", "0.5", "--planner", "greedy", "--drift-bound", "0",
            "--out", str(tmp_path)]
    assert bench_main(argv) == 1
    assert "soak FAILED" in capsys.readouterr().out
    doc = json.loads((tmp_path / "soak_gpt350m-tiny.json").read_text())
    assert doc["benchmark"] == "soak" and doc["command"].startswith("python -m turnip.bench soak --tiny --steps 20")
    assert {"device", "torch", "commit", "date", "workload", "config"} <= doc.keys()
    assert doc["device_type"] == "cpu" and doc["config"]["bounds"] == {"memory": 0.01, "drift": 0.0}
    assert not doc["ok"] and len(doc["failures"]) == 1 and "step time drifted" in doc["failures"][0]
    (run,) = doc["runs"]
    assert run["budget"] == 0.5 and run["status"] == "ok" and run["budget_basis"] == "unplanned peak"
    assert run["cpu_bytes"] > 0 and run["compile_s"] > 0
    assert {key: len(values) for key, values in run["series"].items()} == dict.fromkeys(soak.SERIES, 20)
    assert all(x > 0 for x in run["series"]["step_s"] + run["series"]["host_rss_bytes"])
    assert set(run["series"]["gpu_reserved_bytes"]) == set(run["series"]["pinned_bytes"]) == {0}
    summary = run["summary"]
    assert [c["check"] for c in summary["checks"] if not c["ok"]] == ["step time drift"]
    assert summary["step_s"]["first_window_steps"] == [10, 11] and summary["step_s"]["last_window_steps"] == [19, 20]
    assert summary["host_rss"]["at_base_step"] == run["series"]["host_rss_bytes"][9]
