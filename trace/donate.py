"""Outputs that take the bytes of an input dying at the same op (buffer donation).

Eager PyTorch gives every op's result a fresh block, so at the loss of a language model
the fp32 logits, their log-softmax and, in the backward, the gradient before and after
the log-softmax backward are all live at once: for gpt350m (8 x 1024 tokens, vocabulary
50304) that is 1.5 GiB of the step's peak that no value needs. An op whose kernel reads
element i of an input before it writes element i of its result (elementwise ops, and the
softmax family, which reduce a row before writing it) may write its result over that
input when nothing reads the input afterwards; the numbers are the same kernel's.

This pass rewrites such a vertex into its ``out=`` overload with the output aliasing the
dying input, expressed with the TaskGraph's in-place form (``Vertex.copy_in``): the
builder places the new value over the old one when nothing reads the old one after the op
(memgraph/schedule.py), and copies it first otherwise (a recomputed reader), so the
rewrite is always correct and saves the bytes whenever the order allows.
"""

from __future__ import annotations

import logging

from ..ir.taskgraph import TaskGraph, TensorRef, Value, ValueKind
from ..kernels.ops import op_name, out_variant

log = logging.getLogger(__name__)

# op -> positional arguments its result may overwrite. Only kernels known to read each element
# of that argument before writing the same element of the result (TensorIterator elementwise
# ops; softmax kernels reduce a row before they write it) are listed; tests/test_reuse.py
# checks each one bitwise against the op's own result.
ALIASABLE: dict[str, tuple[int, ...]] = {
    "aten::_log_softmax": (0,),
    "aten::_softmax": (0,),
    "aten::_log_softmax_backward_data": (0,),
    "aten::_softmax_backward_data": (0,),
    "aten::add.Tensor": (0, 1),
    "aten::sub.Tensor": (0, 1),
    "aten::mul.Tensor": (0, 1),
    "aten::div.Tensor": (0, 1),
    "aten::gelu": (0,),
    "aten::gelu_backward": (0, 1),
    "aten::silu": (0,),
    "aten::silu_backward": (0, 1),
    "aten::threshold_backward": (0, 1),
    "aten::tanh_backward": (0, 1),
    "aten::sigmoid_backward": (0, 1),
    "aten::relu": (0,),
    "aten::neg": (0,),
    "aten::pow.Tensor_Scalar": (0,),  # RMSNorm's square, and the scalar arithmetic around it
    "aten::mul.Scalar": (0,),
    "aten::add.Scalar": (0,),
    "aten::div.Scalar": (0,),
    "aten::rsqrt": (0,),
    "aten::exp": (0,),
    "aten::sigmoid": (0,),
    "aten::tanh": (0,),
}


# op -> positional argument whose values the kernel never reads (only its shape, strides and
# dtype): nll_loss's backward zero-fills a tensor like `self` and scatters the gradient at the
# targets. Autograd still saves `self` (under autocast on CUDA the fp32 copy of the
# log-softmax, 1.6 GB for gpt350m) from the forward to the backward; pointing the argument at
# the op's own output buffer, which has that very shape, lets it die in the forward.
METADATA_ONLY: dict[str, int] = {
    "aten::nll_loss_backward": 1,
    "aten::nll_loss2d_backward": 1,
}


def donate_dying_inputs(tg: TaskGraph) -> int:
    """Rewrite, in place, every vertex whose single result can take a dying input's bytes (see
    the module docstring). Returns the number of vertices rewritten."""
    consumers = tg.consumers()
    pinned = set(tg.outputs.values()) | set(tg.bindings) | set(tg.bindings.values())
    rewritten = 0
    for vertex in tg.vertices:
        slots = ALIASABLE.get(vertex.op)
        produced = [o for o in vertex.outputs if o >= 0]
        if slots is None or vertex.copy_in or vertex.random or len(produced) != 1 or len(vertex.outputs) != 1:
            continue
        result = tg.values[produced[0]]
        for slot in slots:
            if slot >= len(vertex.args) or not isinstance(vertex.args[slot], TensorRef):
                continue
            ref = vertex.args[slot]
            donor = tg.values[ref.value]
            if (donor.kind is not ValueKind.INTERMEDIATE or donor.id in pinned
                    or consumers[donor.id][-1] != vertex.id  # program order: this op reads it last
                    or sum(r.value == donor.id for r in vertex.refs()) != 1  # and only through this argument
                    or not _same_layout(donor, result) or donor.nbytes != result.nbytes or ref != donor.dense_ref):
                continue
            variant = out_variant(vertex.op)
            if variant is None or len(variant[1]) != 1:
                continue
            out_op, (out_name,) = variant
            own = result.dense_ref
            args = list(vertex.args)
            args[slot] = own
            vertex.op = op_name(out_op)
            vertex.args = tuple(args)
            vertex.kwargs = {**vertex.kwargs, out_name: own}
            vertex.copy_in = ((donor.id, result.id),)
            rewritten += 1
            break
    unread = read_shape_only_from_own_output(tg)
    log.info("%d ops write their result over a dying input, %d read only the shape of an input", rewritten, unread)
    return rewritten + unread


def read_shape_only_from_own_output(tg: TaskGraph) -> int:
    """Point each METADATA_ONLY argument at its vertex's own output when that output has the same
    shape, strides and dtype, so the value it named is no longer read there."""
    rewritten = 0
    for vertex in tg.vertices:
        slot = METADATA_ONLY.get(vertex.op)
        if slot is None or len(vertex.outputs) != 1 or vertex.outputs[0] < 0 or slot >= len(vertex.args):
            continue
        ref, result = vertex.args[slot], tg.values[vertex.outputs[0]]
        if not isinstance(ref, TensorRef) or ref.value == result.id:
            continue
        named = tg.values[ref.value]
        if not _same_layout(named, result) or ref != named.dense_ref:
            continue
        args = list(vertex.args)
        args[slot] = result.dense_ref
        vertex.args = tuple(args)
        rewritten += 1
    return rewritten


def _same_layout(a: Value, b: Value) -> bool:
    """Whether one value's buffer can stand for the other's: dtype, shape and strides alike."""
    return (a.dtype, tuple(a.shape), tuple(a.stride)) == (b.dtype, tuple(b.shape), tuple(b.stride))
