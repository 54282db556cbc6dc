"""No library warning on every step or load (issue 14): regression losses whose out= kernels
resized a 0-dim output warned each step; pickled loads warned on every load.

Both channels are watched: Python warnings, and what torch's C++ prints straight to stderr when
a warning is raised on a thread outside Python (the CPU backend runs ops on worker threads)."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from turnip.bench.models import mlp

from turnip import engine, gpt, memgraph

LOSSES = {
    "mse": F.mse_loss,
    "smooth_l1": F.smooth_l1_loss,
    "huber": F.huber_loss,
    "l1": F.l1_loss,
}


@contextlib.contextmanager
def nothing_warned(capfd):
    """Assert that the body raises no Python warning and prints none on stderr (from C++ threads)."""
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert not caught, [f"{w.category.__name__}: {w.message}" for w in caught]
    assert "Warning" not in capfd.readouterr().err


def regression_step(loss):
    torch.manual_seed(0)
    model = mlp.MLP(depth=4, hidden=128, d_out=4)
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(32, 32, generator=gen), torch.randn(32, 4, generator=gen))
    return model, (lambda m, b: loss(m(b[0]), b[1])), batch


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_steps_and_loads_warn_nothing(name, tmp_path, capfd):
    model, loss_fn, batch = regression_step(LOSSES[name])
    mg = memgraph.compile(model, loss_fn, batch, optimizer=torch.optim.AdamW(model.parameters()), budget=0.5,
                          device="cpu", verbose=False)
    with nothing_warned(capfd):
        for _ in range(2):
            engine.run(mg, batch)
        mg.save(tmp_path / "step.mg")
        loaded = memgraph.load(tmp_path / "step.mg")
        engine.run(loaded, batch)


def test_gpt_steps_warn_nothing(capfd):
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(n_layers=2, dropout=0.1)
    model = gpt.GPT(cfg)
    batch = gpt.example_batch(cfg)
    mg = memgraph.compile(model, gpt.lm_loss, batch, optimizer=torch.optim.AdamW(model.parameters()), budget=0.5,
                          device="cpu", verbose=False)
    with nothing_warned(capfd):
        for _ in range(2):
            engine.run(mg, batch)
