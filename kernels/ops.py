"""Resolve the op names stored in a TaskGraph back to ATen overloads."""

from __future__ import annotations

import functools

import torch


def op_name(op: torch._ops.OpOverload) -> str:
    """'aten::add.Tensor', or 'aten::mm' for a default overload (inverse of resolve_op)."""
    packet, overload = op._schema.name, op._overloadname
    return packet if overload == "default" else f"{packet}.{overload}"


@functools.cache
def resolve_op(name: str) -> torch._ops.OpOverload:
    namespace, _, rest = name.partition("::")
    packet_name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), packet_name)
        return getattr(packet, overload or "default")
    except (AttributeError, RuntimeError) as err:
        raise ValueError(f"unknown ATen op {name!r} (a synthetic graph cannot be executed)") from err


def flatten_returns(result) -> list:
    """An op's returns as a flat list (nested tuples/lists opened). The trace numbers a vertex's
    outputs by this order and the launcher reads results back by it, so both use this one."""
    if isinstance(result, (tuple, list)):
        flat = []
        for item in result:
            flat.extend(flatten_returns(item))
        return flat
    return [result]


def is_random(op: torch._ops.OpOverload) -> bool:
    return torch.Tag.nondeterministic_seeded in op.tags


# Ops that write arguments their schema does not mark as written: op -> (index of the flag argument that
# says whether they do, indices of the arguments written). BatchNorm in training updates its running
# statistics in place; the trace gives them new versions like any in-place op's.
HIDDEN_MUTATIONS = {
    "aten::native_batch_norm": (5, (3, 4)),
    "aten::cudnn_batch_norm": (5, (3, 4)),
    "aten::miopen_batch_norm": (5, (3, 4)),
}

# Ops whose outputs' sizes only the backend library knows at run time (an RNN's workspace, which the
# fake tensors of the trace give as empty), so no step can preallocate them: refused at trace, with
# what to do instead.
_RNN_ADVICE = ("returns a workspace whose size the backend library decides at run time, which a "
               "preallocated step cannot hold. nn.GRU, nn.RNN and nn.LSTMCell run as ordinary ops; for nn.LSTM, "
               "turn the fused {lib} kernel off for eager and compile alike (with {flag}: ...), so both run the "
               "same ordinary ops")
RUNTIME_SIZED = {
    "aten::mkldnn_rnn_layer": _RNN_ADVICE.format(lib="oneDNN", flag="torch.backends.mkldnn.flags(enabled=False)"),
    "aten::_cudnn_rnn": _RNN_ADVICE.format(lib="cuDNN", flag="torch.backends.cudnn.flags(enabled=False)"),
    "aten::miopen_rnn": _RNN_ADVICE.format(lib="MIOpen", flag="torch.backends.cudnn.flags(enabled=False)"),
}

# Ops whose result is uninitialized memory: with a preallocated output there is nothing to run.
UNINITIALIZED = frozenset({"aten::empty_like", "aten::empty.memory_format", "aten::empty_strided",
                           "aten::new_empty", "aten::new_empty_strided"})


@functools.cache
def out_variant(name: str) -> tuple[torch._ops.OpOverload, tuple[str, ...]] | None:
    """The `out=` overload of a functional op and its out argument names (in return order), if any.
    An op returning a list of tensors (the _foreach_ family) has one out argument taking the list;
    its name is marked with a leading '*'."""
    op = resolve_op(name)
    want = [(a.name, str(a.type)) for a in op._schema.arguments]
    packet = getattr(getattr(torch.ops, op.namespace), op._schema.name.split("::")[1])
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        outs = [("*" if str(a.type).startswith("List[") or str(a.type).endswith("[]") else "") + a.name
                for a in candidate._schema.arguments if a.is_out]
        if outs and [(a.name, str(a.type)) for a in candidate._schema.arguments if not a.is_out] == want:
            if len(outs) == len(op._schema.returns):
                return candidate, tuple(outs)
    return None
