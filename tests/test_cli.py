"""python -m turnip: the subcommands, info and plot on a small saved MemGraph, clear errors."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from turnip.bench.models import mlp
from turnip.memgraph.report import compile_report

from turnip import cli, memgraph

SUBCOMMANDS = ("demo", "info", "plot", "bench")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny MLP compiled on the CPU at half its unplanned peak, saved."""
    torch.manual_seed(0)
    model = mlp.MLP(depth=4, hidden=128)
    mg = memgraph.compile(model, mlp.mlp_loss, mlp.example_batch(batch=32),
                          optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), budget=0.5, device="cpu",
                          verbose=False)
    path = tmp_path_factory.mktemp("cli") / "step.mg"
    mg.save(path)
    return path, mg


def test_help_lists_the_subcommands():
    out = subprocess.run([sys.executable, "-m", "turnip", "--help"], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    for name in SUBCOMMANDS:
        assert f"    {name} " in out.stdout, f"{name} missing from:\n{out.stdout}"


@pytest.mark.parametrize("command,expect", [("info", "usage: python -m turnip info"),
                                            ("plot", "usage: python -m turnip plot"),
                                            ("demo", "usage: python -m turnip.demo"),
                                            ("bench", "usage: python -m turnip.bench")])
def test_every_subcommand_has_help(command, expect, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    assert expect in capsys.readouterr().out


def test_info_prints_the_summary(saved, capsys):
    path, mg = saved
    assert cli.main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{path}: MemGraph(")
    assert " ".join(compile_report(mg).split()) in " ".join(out.split())  # the report, wrapped
    summary = mg.summary()
    assert f"  vertices                     {summary['vertices']}\n" in out
    assert f"  arena_bytes                  {mg.arena_bytes} (" in out
    assert "  budget_fraction              50.0%" in out
    assert "plan mix" in out and "kept on the GPU" in out and "memory per phase" in out
    for phase in ("forward", "backward", "optimizer"):
        assert f"\n  {phase} " in out


def test_plot_writes_a_png(saved, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path, _ = saved
    out = tmp_path / "sub" / "arena.png"
    assert cli.main(["plot", str(path), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.strip() == str(out)


def test_plot_without_matplotlib_says_how_to_get_it(saved, tmp_path, capsys, monkeypatch):
    path, _ = saved
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert cli.main(["plot", str(path), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "plot needs matplotlib" in err and "pip install matplotlib" in err
    assert not (tmp_path / "x.png").exists()


def test_info_on_a_missing_or_foreign_file_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["info", str(tmp_path / "nothing.mg")]) == 2
    assert "error: no such file" in capsys.readouterr().err
    foreign = tmp_path / "foreign.mg"
    foreign.write_text("not a MemGraph")
    assert cli.main(["info", str(foreign)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_bench_forwards_its_arguments(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "nonsense-command"])
    assert done.value.code == 2  # argparse of turnip.bench refused it: the arguments reached it
    assert "invalid choice: 'nonsense-command'" in capsys.readouterr().err


def test_demo_starts_near_ln_vocab_and_matches_eager(capsys):
    assert cli.main(["demo", "--steps", "2", "--layers", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("1 ", "2 "))]
    assert len(rows) == 2, out
    first_turnip, first_eager, same = float(rows[0][1]), float(rows[0][2]), rows[0][3]
    assert abs(first_turnip - math.log(512)) < 0.3, f"first loss {first_turnip}, ln(512) = {math.log(512):.2f}"
    assert first_turnip == first_eager and same == "yes" and rows[1][3] == "yes"
    assert "% of the unplanned peak" in out  # the compile report (stderr is no terminal here, so the demo prints it)
    assert "saved (" in out and "bitwise equal" in out
