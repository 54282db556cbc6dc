"""The suite's budgets: fractions of eager's measured peak (floats) or sizes (ints of bytes, ``16GiB``),
passed to turnip's compile as such, printed readably, and a budget that does not read is a clear error."""

from __future__ import annotations

import pytest
from turnip.bench.__main__ import main
from turnip.bench.peers.turnip_system import budget_argument
from turnip.bench.suite import budget_label, parse_budgets
from turnip.ir.budget import BudgetError

GIB = 2**30


def test_fractions_and_sizes_mix():
    assert parse_budgets("0.6, 25%,16GiB,8GiB,512MiB,1.5GB,") == [0.6, 0.25, 16 * GIB, 8 * GIB, 512 * 2**20,
                                                                   1_500_000_000]
    fraction, size = parse_budgets("1,8GiB")
    assert type(fraction) is float and type(size) is int  # the type says which one it is, through JSON too


@pytest.mark.parametrize(("text", "match"), [
    ("16XB", "unknown unit 'XB'"),
    ("16", "must lie in \\(0, 1\\]; a size needs a unit"),
    ("0", "must lie in \\(0, 1\\]"),
    ("150%", "must lie in \\(0, 1\\]"),
    ("GiB", "cannot read --budgets='GiB'"),
    (" , ", "names no budget"),
])
def test_a_budget_that_does_not_read_is_refused(text, match):
    with pytest.raises(BudgetError, match=match):
        parse_budgets(text)


def test_the_suite_command_refuses_it_before_running_anything(tmp_path):
    with pytest.raises(SystemExit, match="unknown unit 'XB'"):
        main(["suite", "--tiny", "--budgets", "0.5,16XB", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_a_size_reaches_compile_as_bytes_whatever_eagers_peak():
    assert budget_argument(16 * GIB, 40 * GIB) == (16 * GIB, "bytes given")
    assert budget_argument(16 * GIB, None) == (16 * GIB, "bytes given")
    assert budget_argument(0.5, 1000) == (500, "eager peak")  # fractions as before
    assert budget_argument(1.0, None) == (1.0, "unplanned peak")


def test_budget_labels():
    assert [budget_label(b) for b in (0.6, 16 * GIB, 512 * 2**20, None)] == ["0.60", "16GiB", "512MiB", "-"]
