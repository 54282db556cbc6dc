"""Budgets as users write them (ir/budget.py): one meaning, clear refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from cases import make_case
from turnip.bench.models import mlp
from turnip.ir.budget import Budget, BudgetError, budget_fields, check_budget, format_bytes, parse_budget
from turnip.ir.plan import CPU, Plan
from turnip.ir.sizes import aligned
from turnip.memgraph.schedule import Schedule
from turnip.planners.driver import smallest_budget

from turnip import memgraph

PEAK = 10 * 2**30  # a 10 GiB unplanned peak
GiB, MiB = 2**30, 2**20


@pytest.mark.parametrize("budget,want", [
    (None, PEAK),
    (1.0, PEAK),
    (0.5, PEAK // 2),
    (0.25, PEAK // 4),
    ("50%", PEAK // 2),
    (" 12.5 % ", PEAK // 8),
    ("100%", PEAK),
    ("0.5", PEAK // 2),  # a bare number in a string reads like the number: a fraction
    ("6GiB", 6 * GiB),
    ("6 GiB", 6 * GiB),
    ("6gib", 6 * GiB),
    ("512MiB", 512 * MiB),
    ("1.5GB", 1_500_000_000),
    ("2G", 2 * GiB),
    ("512KiB", 512 * 1024),  # a unit makes a small size deliberate
    (6 * GiB, 6 * GiB),
    (MiB, MiB),
    ("6442450944", 6 * GiB),
    (np.int64(3 * GiB), 3 * GiB),
    (np.float32(0.5), PEAK // 2),
])
def test_valid_budgets(budget, want):
    assert parse_budget(budget, PEAK) == want


@pytest.mark.parametrize("budget,match", [
    (1, "did you mean a fraction"),
    (512, "did you mean a fraction"),
    (MiB - 1, "did you mean a fraction"),
    ("1", "did you mean a fraction"),  # a bare number in a string reads like the int it spells
    (0, "must be positive"),
    (-4 * GiB, "must be positive"),
    (1.5, r"must lie in \(0, 1\].*needs a unit"),
    (2.0, r"must lie in \(0, 1\]"),
    (6e9, r"must lie in \(0, 1\]"),
    (0.0, r"must lie in \(0, 1\]"),
    (-0.5, r"must lie in \(0, 1\]"),
    (math.nan, r"must lie in \(0, 1\]"),
    (math.inf, r"must lie in \(0, 1\]"),
    ("150%", r"must lie in \(0, 1\]"),
    ("0%", r"must lie in \(0, 1\]"),
    ("1.5", r"must lie in \(0, 1\]"),
    ("6 parsecs", "unknown unit 'parsecs'"),
    ("GiB", "cannot read"),
    ("", "cannot read"),
    ("-6GiB", "cannot read"),
    ("half", "cannot read"),
    (True, "is not a budget"),
    ([0.5], "is not a budget"),
    (torch.tensor(0.5), "is not a budget"),
])
def test_invalid_budgets_are_refused_clearly(budget, match):
    with pytest.raises(BudgetError, match=match) as info:
        parse_budget(budget, PEAK)
    assert isinstance(info.value, ValueError)
    assert "budget=" in str(info.value)  # names the argument and repeats what was given


def test_fraction_error_names_the_unplanned_peak_when_known():
    with pytest.raises(BudgetError, match=r"unplanned peak \(10.00 GiB\)"):
        parse_budget(1.5, PEAK)
    with pytest.raises(BudgetError, match=r"unplanned peak and must"):
        check_budget(1.5)


def test_the_one_byte_mistake_suggests_a_fraction_and_a_unit():
    with pytest.raises(BudgetError) as info:
        parse_budget(1, PEAK, what="cpu_budget")
    msg = str(info.value)
    assert "cpu_budget=1" in msg and "did you mean a fraction?" in msg and "'50%'" in msg and "'1B'" in msg


def test_check_budget_accepts_what_parse_budget_accepts():
    for budget in (None, 0.5, "50%", "6GiB", 6 * GiB):
        check_budget(budget)  # no error
    with pytest.raises(BudgetError):
        check_budget(1)


def test_budget_fields_report_bytes_and_fraction():
    assert budget_fields(PEAK // 4, PEAK) == {"budget_bytes": PEAK // 4, "unplanned_peak": PEAK,
                                              "budget_fraction": 0.25}
    assert budget_fields(PEAK, None)["budget_fraction"] is None


@pytest.mark.parametrize("n", [0, 1000, 1536, 3 * MiB, 6 * GiB, 5 * 2**40])
def test_compact_sizes_read_back(n):
    if n == 0:
        assert format_bytes(0) == "0 B"
        return
    assert parse_budget(format_bytes(n, compact=True), PEAK) == n


def test_compile_refuses_an_unreadable_budget_before_tracing():
    calls = []

    def loss_fn(model, batch):
        calls.append(1)
        return mlp.mlp_loss(model, batch)

    model = mlp.MLP()
    with pytest.raises(BudgetError, match="did you mean a fraction"):
        memgraph.compile(model, loss_fn, mlp.example_batch(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         budget=1, device="cpu", verbose=False)
    with pytest.raises(BudgetError, match="cpu_budget="):
        memgraph.compile(model, loss_fn, mlp.example_batch(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         budget=0.5, cpu_budget="lots", device="cpu", verbose=False)
    assert not calls, "the step was traced before the budget was read"


@pytest.mark.parametrize("budget", ["50%", 0.5, "0.5"])
def test_compile_reads_every_form_of_a_fraction_alike(budget):
    torch.manual_seed(0)
    model = mlp.MLP(depth=4, hidden=128)
    mg = memgraph.compile(model, mlp.mlp_loss, mlp.example_batch(batch=32),
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1), budget=budget, device="cpu",
                          verbose=False)
    assert mg.plan.gpu_budget == int(0.5 * mg.stats["unplanned_peak"])
    assert mg.arena_bytes <= mg.plan.gpu_budget


def test_a_budget_is_read_once_into_its_form():
    assert Budget.read("50%") == Budget(fraction=0.5, given="'50%'")
    assert Budget.read("6GiB").size == 6 * GiB and Budget.read("6GiB").fraction is None
    assert Budget.read(0.25).bytes(PEAK) == PEAK // 4 == parse_budget(0.25, PEAK)
    assert Budget.read(None).bytes(PEAK) == PEAK
    assert Budget.read(Budget.read("1GiB")) == Budget.read("1GiB")  # a read budget passes through


@pytest.mark.parametrize("name", ["mlp", "gpt", "hf_gpt2"])
@pytest.mark.parametrize("alignment", [1, 64, 256])
def test_the_planners_smallest_budget_is_the_builders_floor_with_every_weight_on_the_cpu(name, alignment):
    """planners.driver.smallest_budget (any plan's floor, the planner's input) and the builder's
    Schedule.plan_floor (one plan's) are one quantity where the plan homes every weight on the CPU."""
    model, loss_fn, batches = make_case(name)
    tg = memgraph.trace(model, loss_fn, batches[0], optimizer=torch.optim.AdamW(model.parameters()))
    plan = Plan(gpu_budget=1 << 60, planner="none", home={v.id: CPU for v in tg.values if v.kind.is_persistent})
    floor, _ = Schedule(tg, list(range(len(tg.vertices))), plan, alignment).plan_floor()
    assert smallest_budget(tg, alignment) == floor


def test_a_zero_byte_value_takes_one_alignment_unit_everywhere():
    assert aligned(0, 256) == aligned(1, 256) == aligned(256, 256) == 256
    assert aligned(257, 256) == 512 and aligned(0, 1) == 1


@pytest.mark.parametrize("largest", [0, 1, 486_309_376, (7 << 20) + 5])
@pytest.mark.parametrize("library", [0, 34_603_008, (1 << 20) + 3])
@pytest.mark.parametrize("budget", [9_957_277_696, 7_965_822_156, 39_829_110_784 + 12_345])
def test_what_the_allocator_reserves_beside_the_arena_fits_the_step_workspace(largest, library, budget):
    """On CUDA the arena is one segment rounded up to 2 MiB; the lane pool's first block (the largest
    op workspace and the library workspaces) is reserved rounded up to 2 MiB; the lane's and the
    caller's pools each add a 2 MiB small segment, and the first GPU one more (two H200s at 25% and
    20%): all of it within the budget, whose step workspace (runtime_reserve = the measured library
    workspace + ALLOCATOR_SLACK) the arena leaves free."""
    from turnip.ir.sizes import ALLOCATOR_SEGMENT, ALLOCATOR_SLACK, arena_capacity, lane_block

    def rounded(n):
        return -(-n // ALLOCATOR_SEGMENT) * ALLOCATOR_SEGMENT

    step_workspace = largest + library + ALLOCATOR_SLACK
    block = lane_block(largest, step_workspace)
    assert block == largest + library
    arena = arena_capacity(budget, step_workspace, 256)
    reserved = rounded(arena) + rounded(block) + 3 * ALLOCATOR_SEGMENT
    assert reserved <= budget
    assert lane_block(largest, largest) == largest  # no measured reserve (off CUDA): the op workspace alone
