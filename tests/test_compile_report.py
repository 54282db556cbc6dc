"""What compile tells the user: the report (memgraph/report.py), the arena's fill over the serial
order (memgraph/occupancy.py), the progress bar and when anything is printed (memgraph/progress.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from turnip.bench.models import mlp
from turnip.ir.memgraph import Kind
from turnip.ir.plan import Plan, Recompute
from turnip.ir.taskgraph import ValueKind
from turnip.memgraph import compiler as compile_module
from turnip.memgraph import progress
from turnip.memgraph.occupancy import PHASES, arena_timeline, memory_by_phase
from turnip.memgraph.report import compile_report, plan_mix

from turnip import memgraph

LOGGER = "turnip.memgraph.compiler"


def tiny_step():
    torch.manual_seed(0)
    model = mlp.MLP(depth=6, hidden=256)
    return model, mlp.mlp_loss, mlp.example_batch(batch=64), torch.optim.AdamW(model.parameters(), lr=1e-3)


def compiled(budget, **kw):
    model, loss_fn, batch, opt = tiny_step()
    return memgraph.compile(model, loss_fn, batch, optimizer=opt, budget=budget, device="cpu", **kw)


@pytest.fixture(scope="module")
def kept():
    return compiled(1.0, verbose=False)


@pytest.fixture(scope="module")
def planned():
    return compiled(0.4, verbose=False)


def test_report_states_budget_peak_arena_and_no_prediction_on_cpu(planned):
    text = compile_report(planned)
    peak = planned.stats["unplanned_peak"]
    assert "budget 1.76 MiB (40% of the unplanned peak" in text
    assert f"{peak / 2**20:.2f} MiB with everything kept" in text
    assert f"arena {planned.arena_bytes / 2**20:.2f} MiB" in text
    assert "step time not predicted (op costs are not measured on the CPU backend)" in text
    mix = plan_mix(planned)
    assert f"{mix.kept} kept" in text and f"{mix.offloaded} offloaded" in text and f"{mix.recomputed} recomputed" in text


def test_plan_mix_of_a_kept_step_keeps_everything(kept):
    mix = plan_mix(kept)
    assert mix.values == len(kept.taskgraph.values)
    assert (mix.kept, mix.offloaded, mix.recomputed, mix.homed_on_cpu, mix.bytes_moved) == (mix.values, 0, 0, 0, 0)
    assert "100% of the unplanned peak" in compile_report(kept)
    assert "no planner (everything fits)" in compile_report(kept)


def test_plan_mix_of_a_planned_step_counts_what_moves(planned):
    mix = plan_mix(planned)
    summary = planned.summary()
    assert mix.offloaded + mix.homed_on_cpu > 0
    assert mix.bytes_moved == summary["bytes_offloaded"] + summary["bytes_reloaded"] > 0
    assert mix.kept + mix.offloaded + mix.recomputed < mix.values  # the CPU-homed ones are counted apart
    moved = {v.value for v in planned.vertices if v.kind is Kind.OFFLOAD}
    assert moved, "a 40% budget should offload"
    assert mix.bytes_h2d + mix.bytes_d2h >= mix.bytes_moved  # the batch and the loss cross it too
    assert mix.bytes_h2d == sum(planned.taskgraph.values[v.value].nbytes for v in planned.vertices
                                if v.kind in (Kind.RELOAD, Kind.INPUT))
    params = [v for v in planned.taskgraph.values if v.kind is ValueKind.PARAMETER]
    streamed = [v for v in params if v.id in planned.homes and planned.homes[v.id].where == "cpu"]
    assert (mix.parameters_streamed, mix.parameters_kept) == (len(streamed), len(params) - len(streamed))
    assert mix.parameters_host_stepped == 0 and mix.half_width_weights == 0 and mix.loss_blocks == 1


def test_plan_mix_counts_recomputed_values():
    model, loss_fn, batch, opt = tiny_step()
    tg = memgraph.trace(model, loss_fn, batch, optimizer=opt, device="cpu")
    # a forward op whose output a backward op reads: recompute it just before that reader
    for b in tg.vertices:
        if b.phase != "backward":
            continue
        sources = [tg.values[x].producer for x in b.inputs() if tg.values[x].producer >= 0]
        forward = [v for v in sources if tg.vertices[v].phase == "forward" and not tg.vertices[v].random]
        if forward:
            break
    else:
        pytest.fail("no forward output read by the backward")
    original = tg.vertices[forward[0]]
    mg = memgraph.build(tg, Plan(gpu_budget=1 << 40, recompute=[Recompute(original.id, b.id)]), alignment=64)
    mg.stats["unplanned_peak"] = mg.arena_bytes
    mix = plan_mix(mg)
    assert mix.recomputed == sum(1 for o in original.outputs if o >= 0)
    assert mix.values == len(tg.values)  # the copy's outputs are not tensors of their own
    assert f"{mix.recomputed} recomputed" in compile_report(mg)


def test_arena_timeline_of_a_kept_step_is_the_packed_peak(kept):
    timeline = arena_timeline(kept)
    assert len(timeline) == len(kept.serial)
    assert max(timeline) == kept.stats["peak_arena_bytes"]
    assert min(timeline) > 0


def test_arena_timeline_stays_inside_the_arena(planned):
    timeline = arena_timeline(planned)
    assert 0 < max(timeline) <= planned.arena_bytes
    rows = memory_by_phase(planned, timeline)
    assert [r.phase for r in rows] == list(PHASES)
    assert sum(r.vertices for r in rows) == len(planned.serial)
    assert max(r.peak_bytes for r in rows) == max(timeline)
    summary = planned.summary()
    assert sum(r.bytes_offloaded for r in rows) == summary["bytes_offloaded"]
    assert sum(r.bytes_reloaded for r in rows) == summary["bytes_reloaded"]


def test_report_is_logged_at_info(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        mg = compiled(0.5, verbose=False)
    logged = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]
    assert logged == [compile_report(mg)]


@pytest.fixture
def terminal(monkeypatch):
    """stderr looks like a terminal to compile and to its progress bar."""
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: True)
    monkeypatch.setattr(compile_module, "stderr_is_terminal", lambda: True)


def test_verbose_on_a_terminal_shows_phases_and_prints_the_report(terminal, capsys):
    mg = compiled(0.5)
    err = capsys.readouterr().err
    for phase in ("tracing", "measuring op costs", "planning (ILP, up to ", "building"):
        assert phase in err, f"progress never named {phase!r}"
    assert compile_report(mg) in err


def test_verbose_false_prints_nothing_even_on_a_terminal(terminal, capsys):
    compiled(0.5, verbose=False)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_nothing_is_printed_when_stderr_is_not_a_terminal(capsys):
    compiled(0.5)  # verbose by default; pytest's captured stderr is no terminal
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_report_not_printed_twice_when_logging_shows_it(terminal, capsys, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        mg = compiled(0.5)
    assert compile_report(mg) not in capsys.readouterr().err
    assert compile_report(mg) in caplog.text


def test_planner_none_skips_measuring_but_still_finishes_the_bar(terminal, capsys):
    model, loss_fn, batch, opt = tiny_step()
    mg = memgraph.compile(model, loss_fn, batch, optimizer=opt, budget=0.95, device="cpu", planner="none")
    err = capsys.readouterr().err
    assert "measuring op costs" not in err and "building" in err
    assert "no planner (the builder evicts what does not fit)" in compile_report(mg)


def test_phases_bar_is_silent_when_disabled(capsys):
    with progress.Phases(["a", "b"], enabled=False) as bar:
        with bar.phase("a"):
            pass
        bar.skip("b")
    assert capsys.readouterr().err == ""


def test_compile_records_how_long_each_phase_took(planned):
    phases = planned.stats["compile_phase_seconds"]
    assert set(phases) == {"tracing", "measuring op costs", "planning", "building"}
    assert all(seconds >= 0 for seconds in phases.values())
    assert sum(phases.values()) == pytest.approx(planned.stats["compile_seconds"])
    assert phases["tracing"] > 0 and phases["planning"] > 0
