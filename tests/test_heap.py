"""memgraph.compile runs with the heap alive on entry frozen (memgraph/heap.py), so the cyclic
collector's full collections skip the program's own objects; it thaws what it froze, and leaves a
program's own freeze alone."""

from __future__ import annotations

import gc

import torch
from turnip.bench.models import mlp

from turnip import memgraph


def _compile_seeing_freeze_counts() -> list[int]:
    torch.manual_seed(0)
    model = mlp.MLP(depth=2, hidden=64)
    seen = []

    def loss_fn(m, batch):
        seen.append(gc.get_freeze_count())  # while compile traces the step
        return mlp.mlp_loss(m, batch)

    memgraph.compile(model, loss_fn, mlp.example_batch(batch=8), optimizer=torch.optim.AdamW(model.parameters()),
                     budget=1.0, device="cpu", verbose=False, cache=False)
    return seen


def test_compile_freezes_the_heap_it_found_and_thaws_it_after():
    assert gc.get_freeze_count() == 0
    before = len(gc.get_objects())
    seen = _compile_seeing_freeze_counts()
    assert seen and min(seen) >= before // 2  # the program's objects were frozen while it traced
    assert gc.get_freeze_count() == 0


def test_a_program_that_froze_its_heap_keeps_its_freeze():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        seen = _compile_seeing_freeze_counts()
        # compile froze nothing more (frozen objects that die leave the count) ...
        assert seen and max(seen) <= frozen
        assert frozen // 2 < gc.get_freeze_count() <= frozen  # ... and thawed nothing of the program's
    finally:
        gc.unfreeze()
