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


def test_an_output_the_kernel_leaves_undefined_keeps_its_place():
    """A traced output the real kernel does not return (None) is skipped, not a crash: the fake tensors
    of a trace can give an empty tensor where CUDA's attention returns none (seen on a 7B prefill)."""
    from turnip.kernels.launch import run_vertex

    torch.manual_seed(0)
    x, grad = torch.randn(4, 8), torch.randn(4, 8)
    _, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [8], None, None, 1e-5)
    tg = TaskGraph()
    inputs = [tg.add_value(tuple(t.shape), tuple(t.stride()), t.dtype, t.numel() * 4, ValueKind.BATCH)
              for t in (grad, x, mean, rstd)]
    outs = [tg.add_value((4, 8), (8, 1), torch.float32, 128) for _ in range(3)]
    args = (*[tg.values[v].dense_ref for v in inputs[:2]], [8], *[tg.values[v].dense_ref for v in inputs[2:]],
            None, None, [True, False, False])
    vid = tg.add_vertex("aten::native_layer_norm_backward.default", args, outputs=tuple(outs))
    values = dict(zip(inputs, (grad, x, mean, rstd), strict=True))
    places = [torch.full((4, 8), 7.0) for _ in range(3)]
    run_vertex(tg.vertices[vid], lambda ref: values[ref.value], places, scalars={}, rng_state=None,
               device=torch.device("cpu"))
    want = torch.ops.aten.native_layer_norm_backward.default(grad, x, [8], mean, rstd, None, None,
                                                             [True, False, False])[0]
    assert torch.equal(places[0], want)
    assert all(torch.equal(p, torch.full((4, 8), 7.0)) for p in places[1:])
    places = [torch.full((4, 8), 7.0) for _ in range(3)]  # the engine's prepared launch, the same
    prepared = PreparedVertex(tg.vertices[vid], lambda ref: values[ref.value], places)
    # this op has an out= form, which the prepared launch takes; CUDA attention has none: the
    # functional call and a copy into each place, as here
    prepared.op, prepared.out_names, prepared.kwargs = torch.ops.aten.native_layer_norm_backward.default, (), {}
    prepared({}, None, torch.device("cpu"))
    assert torch.equal(places[0], want)
    assert all(torch.equal(p, torch.full((4, 8), 7.0)) for p in places[1:])
