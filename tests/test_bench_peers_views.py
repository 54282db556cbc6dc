"""The suite's comparisons between rows: loss differences with eager, the same-memory view, the Pareto
plot, the --systems shorthands and the command's deadline. Synthetic rows, CPU only."""

from __future__ import annotations

import json
import math

import pytest
from turnip.bench.peers import PEERS
from turnip.bench.suite import (
    ALL_SYSTEMS,
    SuiteConfig,
    annotate,
    expand_systems,
    format_same_memory,
    max_loss_diff,
    run_suite,
    same_memory,
)

GIB = 2**30


def row(system, step_ms, peak_gib, status="ok", budget=None, math_label="eager", **kw):
    return {"model": "m", "system": system, "budget": budget, "status": status,
            "step_s_median": step_ms / 1e3 if step_ms is not None else None,
            "peak_allocated": int(peak_gib * GIB) if peak_gib is not None else None, "math": math_label, **kw}


@pytest.fixture
def rows():
    return [
        row("eager", 180, 34.6, losses=[10.0, 8.0, 6.0]),
        row("checkpoint", 213, 24.5, losses=[10.0, 8.01, 6.03]),
        row("torchao_offload_grads", 500, 12.1),
        row("deepspeed_zero2", 820, 15.5),
        row("deepspeed_zero2_bf16", 693, 7.35, math_label="bf16 weights"),
        row("deepspeed_zero3", 1123, 7.5, math_label="bf16 weights"),
        row("torchtune", None, None, status="oom"),  # failed: never a candidate
        row("fast_but_failed", 1, 1.0, status="error"),
        row("turnip", 260, 20.0, budget=0.6, budget_bytes=int(20.7 * GIB)),
        row("turnip", 400, 10.5, budget=0.3, budget_bytes=int(10.4 * GIB)),  # overshot its budget: cap = its peak
        row("turnip", 300, 2.0, budget=0.05, budget_bytes=int(1.7 * GIB)),  # nothing fits
        row("turnip", None, None, status="infeasible", budget=0.01, budget_bytes=int(0.3 * GIB)),
    ]


def test_same_memory_picks_the_fastest_system_that_fits(rows):
    view = {e["budget"]: e for e in same_memory(rows)}
    at_06 = view[0.6]  # cap 20.7 GiB: checkpoint (24.5) and eager do not fit; torchao 12.1 fits and is fastest
    assert at_06["cap_bytes"] == int(20.7 * GIB)
    assert (at_06["peer"], at_06["peer_math"]) == ("torchao_offload_grads", "eager")
    assert at_06["speedup"] == pytest.approx(500 / 260)
    assert at_06["eager_math_peer"] == "torchao_offload_grads"
    at_03 = view[0.3]  # cap = turnip's own peak 10.5 GiB: only the bf16-weight rows fit
    assert at_03["cap_bytes"] == int(10.5 * GIB)
    assert (at_03["peer"], at_03["peer_math"]) == ("deepspeed_zero2_bf16", "bf16 weights")
    assert at_03["speedup"] == pytest.approx(693 / 400)
    assert at_03["eager_math_peer"] is None and at_03["eager_math_speedup"] is None
    assert view[0.05]["peer"] is None and view[0.05]["speedup"] is None
    infeasible = view[0.01]  # turnip did not run: no speed-up, and still nothing that fits
    assert infeasible["turnip_step_s"] is None and infeasible["speedup"] is None and infeasible["peer"] is None


def test_same_memory_in_rows_and_table(rows):
    annotate(rows)
    turnip = next(r for r in rows if r["system"] == "turnip" and r["budget"] == 0.6)
    assert turnip["same_memory_peer"] == "torchao_offload_grads"
    assert turnip["same_memory_speedup"] == pytest.approx(500 / 260)
    table = format_same_memory(rows)
    line = next(x for x in table.splitlines() if x.split()[1:2] == ["0.60"])
    assert "torchao_offload_grads" in line and "1.92x" in line
    assert "none fits" in next(x for x in table.splitlines() if x.split()[1:2] == ["0.05"])


def test_max_loss_diff():
    assert max_loss_diff([1.0, 2.0, 3.0], [1.0, 2.5, 2.9]) == pytest.approx(0.5)
    assert max_loss_diff([1.0, 2.0], [1.0, 2.0, 9.0]) == 0.0  # only the steps both ran
    assert max_loss_diff([1.0, float("nan")], [1.0, 2.0]) == math.inf
    assert max_loss_diff([], [1.0]) is None


def test_annotate_compares_every_row_with_eager(rows):
    annotate(rows)
    by_system = {r["system"]: r for r in rows if r["system"] != "turnip"}
    assert "max_loss_diff" not in by_system["eager"]  # the reference itself
    assert by_system["checkpoint"]["max_loss_diff"] == pytest.approx(0.03)
    assert by_system["checkpoint"]["peak_fraction_of_eager"] == pytest.approx(24.5 / 34.6, rel=1e-6)
    assert "max_loss_diff" not in by_system["torchtune"]  # no losses to compare


def test_pareto_plot_writes_a_png(rows, tmp_path):
    pytest.importorskip("matplotlib")
    from turnip.bench.plots import pareto_front, plot_pareto

    assert pareto_front([(3, 1), (1, 5), (2, 6), (2, 2)]) == [(1, 5), (2, 2), (3, 1)]
    path = plot_pareto(rows, tmp_path / "m_pareto.png", title="m")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    empty = plot_pareto([row("eager", 1, None)], tmp_path / "cpu.png")  # a CPU run: no peaks, still a figure
    assert empty.read_bytes()[:4] == b"\x89PNG"


def test_systems_shorthands():
    assert expand_systems(["all"]) == list(ALL_SYSTEMS) and ALL_SYSTEMS[0] == "eager"
    assert expand_systems(["peers", "turnip"]) == ["eager", "turnip", *(p for p in PEERS if p != "eager")]
    assert "offload" not in expand_systems(["all"]) and "offload" in expand_systems(["torch"])
    assert expand_systems(["torch", "checkpoint", "torchao"]) == ["eager", "eager_fused", "checkpoint", "offload",
                                                                  "checkpoint_offload", "torchao"]
    assert expand_systems(["offloading"])[0] == "deepspeed_zero2"
    with pytest.raises(ValueError, match="unknown system 'deepspeed'"):
        expand_systems(["deepspeed"])


def test_the_command_deadline_turns_what_is_left_into_timeout_rows(tmp_path):
    cfg = SuiteConfig(models=["gpt350m"], budgets=[1.0, 0.5], steps=1, systems=["eager", "checkpoint", "turnip"],
                      tiny=True, device="cpu", out=tmp_path, time_limit=1.0, plots=False)
    rows = run_suite(cfg)
    assert [(r["system"], r["budget"], r["status"]) for r in rows] == [
        ("eager", None, "timeout"), ("checkpoint", None, "timeout"), ("turnip", 1.0, "timeout"),
        ("turnip", 0.5, "timeout")]
    assert all(r["error"].startswith("not started") for r in rows)


def test_table_merges_split_runs_and_compares_them(rows, tmp_path, capsys):
    from turnip.bench.__main__ import main

    first = [r for r in rows if r["system"] != "turnip"]
    second = [rows[0], *[r for r in rows if r["system"] == "turnip"]]  # --systems eager,turnip --tag b
    for name, part in (("suite_m.json", first), ("suite_m_b.json", second)):
        (tmp_path / name).write_text(json.dumps({"rows": part}))
    assert main(["table", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.split()[1:2] == ["0.60"] and "x" in x)
    assert "torchao_offload_grads" in line and "1.92x" in line


def test_merged_runs_later_date_wins_and_rows_keep_their_own_eager(tmp_path):
    """Split runs of one model merge by the date each file records (a git checkout resets mtimes),
    and a row from a run with its own eager row is compared with that eager, not the other run's."""
    from turnip.bench.results import load_suite_rows

    def write(name, date, rows):
        (tmp_path / name).write_text(json.dumps({"date": date, "rows": rows}))

    # the earlier run is written last, so its mtime is the newest: the date must still decide
    write("suite_m_b.json", "2026-11-23T15:40:00+00:00",
          [row("eager", 181, 34.6, losses=[10.0, 8.0]), row("turnip", 600, 7.3, budget=0.21, losses=[10.0, 8.5])])
    write("suite_m.json", "2026-11-23T15:00:00+00:00",
          [row("eager", 179, 34.6, losses=[10.0, 9.0]), row("turnip", 999, 7.3, budget=0.21, status="timeout"),
           row("checkpoint", 213, 24.5, losses=[10.0, 9.25], max_loss_diff=0.25)])  # as its run wrote it
    merged = load_suite_rows(tmp_path)["m"]
    by_key = {(r["system"], r["budget"]): r for r in merged}
    assert by_key[("turnip", 0.21)]["status"] == "ok" and by_key[("eager", None)]["step_s_median"] == 0.181
    annotate(merged)
    assert by_key[("turnip", 0.21)]["max_loss_diff"] == pytest.approx(0.5)  # against its own run's eager (8.0)
    # its run's eager (9.0) was replaced by the later run's (8.0): its own comparison stands, not 1.25
    assert by_key[("checkpoint", None)]["max_loss_diff"] == pytest.approx(0.25)
