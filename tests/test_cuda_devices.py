"""Several GPUs in one MemGraph (compile's devices=): the step against eager accumulating the
devices' micro-batches on one GPU with DDP's averaging, within the float tolerance that eager's own
two runs of the same step differ by. Skipped without two CUDA devices."""

from __future__ import annotations

import copy

import pytest
import torch
from cases import make_case
from test_devices import adamw, eager_data_parallel, per_device
from turnip.ir.errors import InfeasibleBudget
from turnip.ir.memgraph import Stream

from turnip import engine, memgraph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices")


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float().cpu() - b[k].float().cpu()).abs().max()) for k in b)


def compile_at_least_the_floor(model, loss_fn, batch, make_opt, budget, **options):
    """memgraph.compile on a deep copy of ``model``; a fraction below what the tiny step can work in
    (its op workspace alone is most of its peak on an H200) becomes the smallest budget that works,
    plus 5%."""
    mine = copy.deepcopy(model)
    try:
        return memgraph.compile(mine, loss_fn, batch, optimizer=make_opt(mine.parameters()), device="cuda",
                                budget=budget, verbose=False, **options)
    except InfeasibleBudget as too_small:
        mine = copy.deepcopy(model)
        return memgraph.compile(mine, loss_fn, batch, optimizer=make_opt(mine.parameters()), device="cuda",
                                budget=int(too_small.minimum * 1.05), verbose=False, **options)


def sgd(params):  # linear in the gradient: a rounding difference stays one (Adam's ratio amplifies those of
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # gradients that cancel to about zero up to lr)


@pytest.mark.parametrize("devices", [2, torch.cuda.device_count() if torch.cuda.is_available() else 2])
@pytest.mark.parametrize("budget", [None, 0.7, 0.4])
@pytest.mark.parametrize("make_opt", [sgd, adamw])
def test_gpus_match_eager_averaged_accumulation(devices, budget, make_opt):
    model, loss_fn, batches = make_case("gpt", device="cuda")
    steps = per_device(batches, devices, steps=3)
    want, want_losses = eager_data_parallel(model, loss_fn, steps, make_opt)
    again, _ = eager_data_parallel(model, loss_fn, steps, make_opt)
    spread = _max_diff(again, want)  # eager against itself: the kernels' own run-to-run differences
    mg = compile_at_least_the_floor(model, loss_fn, batches[0], make_opt, budget, devices=devices)
    assert memgraph.verify(mg) == []
    assert {p.device for mv in mg.vertices for p in mv.writes.values() if p.where == "gpu"} == set(range(devices))
    assert any(mv.stream is Stream.D2D for mv in mg.vertices)
    for micro_batches, losses in zip(steps, want_losses):
        out = engine.run(mg, micro_batches)
        got = out["losses"].float().cpu()
        assert torch.allclose(got, losses.float().cpu(), rtol=1e-5, atol=1e-5), (got, losses)
    diff = _max_diff(mg.state_dict(), want)
    # eager is deterministic here (spread 0): the bound is float rounding, SGD's tight; Adam's at most a
    # share of one step's lr, where a near-zero gradient's own rounding decides its update's size
    bound = 2e-5 if make_opt is sgd else 0.5 * 1e-3
    assert diff <= max(10 * spread, bound), (diff, spread)
    for d in range(devices):  # every device holds its arena
        assert torch.cuda.memory_allocated(d) >= mg.arena_bytes
    mg.release(keep=False)


def test_the_cost_model_of_a_step_over_two_gpus_measures_what_the_host_moves_over_both(tmp_path):
    """Both links copying at once move more than one alone and no more than two alone, each way;
    with both directions busy, more than either direction alone. A one-device model caps nothing."""
    from turnip.planners.costs import CostModel

    one = CostModel(device="cuda", cache_dir=tmp_path)
    assert one.host_links.h2d is None and one.host_links.both is None
    two = CostModel(device="cuda", devices=2, cache_dir=tmp_path)
    links = two.host_links
    for together, alone in ((links.h2d, one.h2d_bandwidth), (links.d2h, one.d2h_bandwidth)):
        assert 0.9 * alone < together <= 2.1 * alone
    assert links.both > 0.9 * max(links.h2d, links.d2h)
    assert CostModel(device="cuda", devices=2, cache_dir=tmp_path).host_links == links  # cached by count
