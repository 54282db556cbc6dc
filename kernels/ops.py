"""Resolve the op names stored in a TaskGraph back to ATen overloads."""

from __future__ import annotations

import functools
from collections.abc import Iterable

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


def draws(vertex) -> bool:
    """Whether a random vertex really draws: an attention op whose dropout probability is 0 leaves
    the generator as it was (its schema is random for the dropout it may do)."""
    if not vertex.random:
        return False
    if "attention" not in vertex.op:
        return True
    names = [a.name for a in resolve_op(vertex.op)._schema.arguments]
    if "dropout_p" not in names:
        return True
    i = names.index("dropout_p")
    p = vertex.args[i] if i < len(vertex.args) else vertex.kwargs.get("dropout_p", 0.0)
    return p != 0


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
        if outs and [(a.name, str(a.type)) for a in candidate._schema.arguments if not a.is_out] == want \
                and len(outs) == len(op._schema.returns):
            return candidate, tuple(outs)
    return None


class KernelRefusal(RuntimeError):
    """An op's inputs that eager's own kernel refuses, found while tracing (the message is eager's)."""


def _grouped_mm_strides_ok(mat: torch.Tensor) -> None:
    """ATen's check_valid_strides_and_return_transposed: the last two dimensions are row- or
    column-major with the leading stride a multiple of 16 bytes."""
    stride, size, alignment = mat.stride(), mat.shape, 16 // mat.element_size()
    if stride[-2] == 1 and stride[-1] >= max(1, size[-2]):
        lead = stride[-1]
    elif stride[-1] == 1 and stride[-2] >= max(1, size[-1]):
        lead = stride[-2]
    else:
        raise KernelRefusal(f"Invalid strides/sizes, got {list(stride)} for strides and {list(size)} for sizes")
    if lead % alignment:
        raise KernelRefusal("strides should be multiple of 16 bytes")


def grouped_mm_layout(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    """(size, stride, dtype) of the result of aten::_grouped_mm as its kernels make it, after their
    checks (ATen's GroupedMMUtils.h: _grouped_mm_validate_inputs, _resolve_grouped_mm_out_dtype,
    create_grouped_gemm_output_tensor, then mm_out per group, which needs one dtype); the CPU kernel
    and CUDA's (its bfloat16 fast path and its per-group fallback for the other dtypes) share these
    helpers. Torch's meta kernel is the CUDA fast path's: it refuses every dtype but bfloat16 and,
    on a CPU-only build, does not pad the strides as the kernels do. The kernels take float32,
    bfloat16 and float16; the CPU's reads the group offsets on the host, but the result's shape
    never depends on them."""
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        if mat.dtype not in (torch.bfloat16, torch.float32, torch.float16):
            kind = str(mat.dtype).removeprefix("torch.").capitalize()
            raise KernelRefusal(f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {kind}")
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        if mat.dim() not in (2, 3):
            raise KernelRefusal(f"{name} has to be 2 or 3d")
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if (not a_2d or not b_2d) and mat_a.shape[-1] != mat_b.shape[-2]:
        raise KernelRefusal("contraction dimension of mat_a and mat_b must match")
    _grouped_mm_strides_ok(mat_a)
    _grouped_mm_strides_ok(mat_b)
    if (offs is not None) != (a_2d or b_2d):
        raise KernelRefusal("Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None and offs.dim() != 1:
        raise KernelRefusal("offs has to be 1D")
    if offs is not None and offs.dtype != torch.int32:
        raise KernelRefusal("Offsets have to be int32")
    if bias is not None:
        raise KernelRefusal("Bias not supported yet")
    dtype = out_dtype if out_dtype is not None else mat_a.dtype
    if dtype != mat_a.dtype:
        raise KernelRefusal("Grouped gemm output dtype must match `mat_a` dtype")
    if a_2d and b_2d:
        size = [offs.shape[0], mat_a.shape[0], mat_b.shape[1]]
    elif a_2d or b_2d:
        groups, rows, cols = (mat_b.shape[0], mat_a.shape[0], mat_b.shape[-1]) if a_2d else \
            (mat_a.shape[0], mat_a.shape[1], mat_b.shape[1])
        if offs.shape[0] != groups:
            raise KernelRefusal("matrix batch sizes have to match")
        size = [rows, cols]
    else:
        if mat_a.shape[0] != mat_b.shape[0]:
            raise KernelRefusal("batched dimension has to match")
        size = [mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1]]
    if mat_a.dtype != mat_b.dtype:  # what each group's mm_out says
        raise KernelRefusal(f"expected m1 and m2 to have the same dtype, but got: {mat_a.dtype} != {mat_b.dtype}")
    alignment = 16 // dtype.itemsize  # rows padded to 16 bytes (for TMA transfers on CUDA; the CPU kernel too)
    padded = -(-size[-1] // alignment) * alignment
    stride = [padded, 1] if len(size) == 2 else [size[1] * padded, padded, 1]
    return size, stride, dtype


def reads_on_host(name: str, dtypes: Iterable[torch.dtype], device_type: str) -> bool:
    """Whether the op's kernel copies a device tensor to the host, which no CUDA graph can capture:
    CUDA's aten::_grouped_mm outside its bfloat16 fast path runs one mm per group, reading the
    group offsets on the host (Hugging Face's default experts under autocast keep float32 weights
    and cast the tokens to them, so a Mixtral takes that path)."""
    return device_type == "cuda" and name == "aten::_grouped_mm" and \
        any(d.is_floating_point and d != torch.bfloat16 for d in dtypes)


# Ops whose fake (meta) kernel refuses inputs or gives a layout that the kernels eager runs do not:
# op -> the layout function the trace uses instead (trace/tracer.py).
KERNEL_LAYOUTS = {"aten::_grouped_mm": grouped_mm_layout}
