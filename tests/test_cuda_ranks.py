"""Two ranks (processes) of one GPU each through NCCL (compile's process_group=): the step equals the
one-process MemGraph over both GPUs (compile's devices=2), which test_cuda_devices.py checks against
eager, within the float tolerance that eager's own two runs differ by. Skipped without two CUDA
devices."""

from __future__ import annotations

import copy

import pytest
import torch
from cases import make_case
from test_devices import adamw, per_device
from test_ranks import run_ranks
from turnip.ir.memgraph import Stream

from turnip import engine, memgraph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices")


def _steps(budget, path: str) -> list:
    """One process over both GPUs: the losses and the final weights, saved for the ranks to compare."""
    model, loss_fn, batches = make_case("gpt", device="cuda")
    mine = copy.deepcopy(model)
    mg = memgraph.compile(mine, loss_fn, batches[0], optimizer=adamw(mine.parameters()), device="cuda", devices=2,
                          budget=budget, verbose=False)
    losses = [engine.run(mg, micro)["loss"].cpu() for micro in per_device(batches, 2, steps=3)]
    state = {k: v.cpu() for k, v in mg.state_dict().items()}
    mg.release(keep=False)
    torch.save({"losses": losses, "state": state}, path)
    return losses


def _rank_steps(rank: int, ranks: int, budget, path: str) -> str:
    model, loss_fn, batches = make_case("gpt", device="cuda")
    want = torch.load(path, weights_only=True)  # tensors and containers of them only: no code runs
    mine = copy.deepcopy(model)
    mg = memgraph.compile(mine, loss_fn, batches[0], optimizer=adamw(mine.parameters()), device="cuda",
                          budget=budget, verbose=False)
    assert mg.device == f"cuda:{rank}" and any(mv.stream is Stream.COMM for mv in mg.vertices)
    assert memgraph.verify(mg) == []
    for micro, loss in zip(per_device(batches, 2, steps=3), want["losses"]):
        got = engine.run(mg, micro[rank])["loss"].cpu()
        assert torch.allclose(got, loss, rtol=1e-5, atol=1e-5), (got, loss)
    diff = max(float((v.float().cpu() - want["state"][k].float()).abs().max()) for k, v in mg.state_dict().items())
    assert diff <= 0.5 * 1e-3, diff  # Adam's bound of test_cuda_devices.py
    assert torch.cuda.memory_allocated(rank) >= mg.arena_bytes
    return f"ok, weights within {diff:.2e} of the one-process step"


@pytest.mark.parametrize("budget", [None, 0.7])
def test_two_ranks_of_one_gpu_match_one_process_over_two(tmp_path, budget):
    path = str(tmp_path / "want.pt")
    _steps(budget, path)
    torch.cuda.empty_cache()
    reports = run_ranks(_rank_steps, 2, tmp_path, budget, path, backend="nccl")
    for rank, text in enumerate(reports):
        assert text.startswith("ok"), f"rank {rank}: {text}"
