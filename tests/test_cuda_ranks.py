"""Ranks (processes) of one or two GPUs each through NCCL (compile's process_group=): the step equals
the one-process MemGraph over all their GPUs (compile's devices=), which test_cuda_devices.py checks
against eager, within the float tolerance that eager's own two runs differ by. Two ranks of one GPU
need two CUDA devices, two ranks of two GPUs four; skipped without them."""

from __future__ import annotations

import copy

import pytest
import torch
from cases import make_case
from test_cuda_devices import compile_at_least_the_floor
from test_devices import adamw, per_device
from test_ranks import run_ranks
from turnip.ir.memgraph import Stream

from turnip import engine, memgraph

RANKS = 2


def _steps(budget, devices: int, path: str) -> list:
    """One process over every GPU: the losses, the final weights and the budget in bytes, saved for
    the ranks to compare. A fraction below what the tiny step can work in (its op workspace alone is
    most of its peak on an H200) becomes the smallest budget that works, plus 5%."""
    model, loss_fn, batches = make_case("gpt", device="cuda")
    mg = compile_at_least_the_floor(model, loss_fn, batches[0], adamw, budget, devices=devices)
    losses = [engine.run(mg, micro)["loss"].cpu() for micro in per_device(batches, devices, steps=3)]
    state = {k: v.cpu() for k, v in mg.state_dict().items()}
    budget_bytes = mg.plan.gpu_budget if budget is not None else None
    mg.release(keep=False)
    torch.save({"losses": losses, "state": state, "budget": budget_bytes}, path)
    return losses


def _rank_steps(rank: int, ranks: int, local: int, path: str) -> str:
    model, loss_fn, batches = make_case("gpt", device="cuda")
    want = torch.load(path, weights_only=True)  # tensors and containers of them only: no code runs
    mine = copy.deepcopy(model)
    mg = memgraph.compile(mine, loss_fn, batches[0], optimizer=adamw(mine.parameters()), device="cuda",
                          devices=local, budget=want["budget"], verbose=False)
    assert mg.device == f"cuda:{rank * local}" and any(mv.stream is Stream.COMM for mv in mg.vertices)
    assert memgraph.verify(mg) == []
    for micro, loss in zip(per_device(batches, ranks * local, steps=3), want["losses"]):
        mine_micro = micro[rank * local:(rank + 1) * local]
        got = engine.run(mg, mine_micro if local > 1 else mine_micro[0])["loss"].cpu()
        assert torch.allclose(got, loss, rtol=1e-5, atol=1e-5), (got, loss)
    state = mg.state_dict()
    assert state and set(state) <= set(want["state"])
    diff = max(float((v.float().cpu() - want["state"][k].float()).abs().max()) for k, v in state.items())
    assert diff <= 0.5 * 1e-3, diff  # Adam's bound of test_cuda_devices.py
    for gpu in range(rank * local, (rank + 1) * local):
        assert torch.cuda.memory_allocated(gpu) >= mg.arena_bytes, gpu
    return f"ok, weights within {diff:.2e} of the one-process step"


@pytest.mark.parametrize("local", [1, 2])
@pytest.mark.parametrize("budget", [None, 0.7])
def test_ranks_match_one_process_over_all_their_gpus(tmp_path, budget, local):
    if not torch.cuda.is_available() or torch.cuda.device_count() < RANKS * local:
        pytest.skip(f"needs {RANKS * local} CUDA devices")
    path = str(tmp_path / "want.pt")
    _steps(budget, RANKS * local, path)
    torch.cuda.empty_cache()
    reports = run_ranks(_rank_steps, RANKS, tmp_path, local, path, backend="nccl", gpus_per_rank=local)
    for rank, text in enumerate(reports):
        assert text.startswith("ok"), f"rank {rank}: {text}"
