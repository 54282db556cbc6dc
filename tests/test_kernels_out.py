"""The engine's launch never writes outside a value's bytes, even where an op's out= form would."""

from __future__ import annotations

import pytest
import torch
from turnip.ir.taskgraph import TaskGraph, ValueKind
from turnip.kernels.launch import PreparedVertex

LOSSES = {  # op, extra arguments after (input, target), target transform
    "aten::huber_loss": ((1, 1.0), lambda t: t),
    "aten::soft_margin_loss": ((1,), torch.sign),
    "aten::binary_cross_entropy": ((None, 1), torch.sigmoid),
    "aten::mse_loss": ((1,), lambda t: t),
    "aten::smooth_l1_loss": ((1, 1.0), lambda t: t),
}


@pytest.mark.parametrize("op", sorted(LOSSES))
def test_a_scalar_loss_writes_only_its_own_bytes(op):
    extra, target_of = LOSSES[op]
    torch.manual_seed(0)
    x = torch.rand(16, 4) if op == "aten::binary_cross_entropy" else torch.randn(16, 4)
    y = target_of(torch.randn(16, 4))
    tg = TaskGraph()
    vx = tg.add_value((16, 4), (4, 1), torch.float32, 256, ValueKind.BATCH)
    vy = tg.add_value((16, 4), (4, 1), torch.float32, 256, ValueKind.BATCH)
    out = tg.add_value((), (), torch.float32, 4)
    vid = tg.add_vertex(op + ".default", (tg.values[vx].dense_ref, tg.values[vy].dense_ref, *extra), outputs=(out,))
    arena = torch.zeros(64)  # the loss's 4 bytes, then a neighbour's
    values = {vx: x, vy: y}
    prepared = PreparedVertex(tg.vertices[vid], lambda ref: values[ref.value], [arena[:1].view(())])
    prepared({}, None, torch.device("cpu"))
    assert arena[1:].abs().sum() == 0, f"{op} wrote past its output"
    want = getattr(torch.ops.aten, op.split("::")[1]).default(x, y, *extra)
    assert torch.equal(arena[0], want)
