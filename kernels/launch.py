"""Run one TaskGraph vertex: its ATen op over resolved views, results into preallocated outputs.

Shared by the reference executor (outputs allocated here) and the engines
(outputs are views of arena bytes). In-place ops run in place on the output
buffer after copying the old version in, so every kernel is the one eager
PyTorch runs and the numbers match bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ..ir.taskgraph import ScalarRef, TensorRef, Vertex
from .ops import UNINITIALIZED, flatten_returns, out_variant, resolve_op
from .rng import replay
from .views import ref_view

Resolve = Callable[[TensorRef], torch.Tensor]


def _materialize(template, resolve: Resolve, scalars: Mapping[str, float]):
    if isinstance(template, TensorRef):
        return resolve(template)
    if isinstance(template, ScalarRef):
        return scalars[template.name]
    if isinstance(template, list):
        return [_materialize(t, resolve, scalars) for t in template]
    if isinstance(template, tuple):
        return tuple(_materialize(t, resolve, scalars) for t in template)
    if isinstance(template, dict):
        return {k: _materialize(t, resolve, scalars) for k, t in template.items()}
    return template


def run_vertex(vertex: Vertex, resolve: Resolve, outputs: Sequence[torch.Tensor | None] | None,
               scalars: Mapping[str, float], rng_state: torch.Tensor | None, device: torch.device,
               allocate: Callable[[int], torch.Tensor] | None = None) -> list[torch.Tensor | None]:
    """Run `vertex`. `resolve(ref)` gives a view of an input value. `outputs[i]` is the buffer of
    value vertex.outputs[i] (None where the output is unused); pass outputs=None to let the op
    allocate (functional ops) or `allocate(value_id)` create the buffer (in-place ops).
    Returns the output tensors."""
    op = resolve_op(vertex.op)
    outs: list[torch.Tensor | None] = list(outputs) if outputs is not None else [None] * len(vertex.outputs)
    own = {vid: i for i, vid in enumerate(vertex.outputs) if vid >= 0}
    if vertex.copy_in:
        for old, new in vertex.copy_in:
            i = own[new]
            if outs[i] is None:
                outs[i] = allocate(new)
            src = resolve(TensorRef(old, tuple(outs[i].shape), tuple(outs[i].stride()), 0))
            outs[i].copy_(src)

    def resolve_own(ref: TensorRef) -> torch.Tensor:
        i = own.get(ref.value)
        return ref_view(outs[i], ref) if i is not None else resolve(ref)

    args = _materialize(vertex.args, resolve_own, scalars)
    kwargs = _materialize(vertex.kwargs, resolve_own, scalars)
    result = replay(rng_state, device, lambda: op(*args, **kwargs))
    if vertex.copy_in:  # in-place: the outputs already hold the result
        return outs
    flat = flatten_returns(result)
    if len(flat) < len(vertex.outputs):
        raise RuntimeError(f"{vertex.op} returned {len(flat)} results, the graph expects {len(vertex.outputs)}")
    for i, vid in enumerate(vertex.outputs):
        if vid < 0:
            continue
        if flat[i] is None:
            # an output the real kernel leaves undefined where the fake tensors of the trace gave an
            # empty one (CUDA attention's sequence offsets and RNG seeds when it does not need them):
            # no vertex of the eager step could read it, so its place is left as it is
            continue
        if outs[i] is None:
            outs[i] = flat[i]
        else:
            if tuple(outs[i].shape) != tuple(flat[i].shape):
                raise RuntimeError(f"{vertex.op} output {i} has shape {tuple(flat[i].shape)}, "
                                   f"its place holds {tuple(outs[i].shape)}")
            outs[i].copy_(flat[i])
    return outs


def scalar_names(template) -> set[str]:
    """The per-step scalars (ScalarRef names) an argument template reads."""
    if isinstance(template, ScalarRef):
        return {template.name}
    if isinstance(template, (list, tuple)):
        return set().union(*(scalar_names(t) for t in template))
    if isinstance(template, dict):
        return scalar_names(list(template.values()))
    return set()


# Functional ops with no out= overload whose result is written straight into the output buffer by
# the very call the op makes internally (_to_copy is empty + copy_; *_like fills), so the numbers
# are the op's own and no scratch result is allocated.
DIRECT = {
    "aten::_to_copy": lambda out, args, kwargs: out.copy_(args[0]),
    "aten::ones_like": lambda out, args, kwargs: out.fill_(1),
    "aten::zeros_like": lambda out, args, kwargs: out.fill_(0),
    "aten::full_like": lambda out, args, kwargs: out.fill_(args[1]),
}


def writes_in_place(vertex: Vertex) -> bool:
    """True when an engine runs the vertex straight into its output buffers (out= overload,
    in-place op, direct write, or nothing to run), so it needs no scratch copy of its result."""
    if vertex.copy_in or vertex.op in UNINITIALIZED or (vertex.op in DIRECT and vertex.outputs[0] >= 0):
        return True
    if any(o < 0 for o in vertex.outputs):
        return False
    try:
        return out_variant(vertex.op) is not None
    except ValueError:  # not an ATen op (synthetic graphs): assume the worst
        return False


class PreparedVertex:
    """A vertex bound once to fixed input views and output buffers, for engines whose places never move.

    Uses the op's `out=` overload when every output has a buffer, so nothing is
    allocated and nothing copied; otherwise computes then copies (the temporaries
    are the op's declared workspace). Uninitialized-memory ops run nothing.
    """

    def __init__(self, vertex: Vertex, resolve: Resolve, outputs: Sequence[torch.Tensor | None]):
        self.vertex = vertex
        self.outputs = list(outputs)
        own = {vid: i for i, vid in enumerate(vertex.outputs) if vid >= 0}
        if any(self.outputs[i] is None for i in own.values()):
            raise ValueError(f"vertex {vertex.id} ({vertex.op}): every produced value needs a buffer")

        def resolve_own(ref: TensorRef) -> torch.Tensor:
            i = own.get(ref.value)
            return ref_view(self.outputs[i], ref) if i is not None else resolve(ref)

        self.in_place = bool(vertex.copy_in)  # the op mutates its outputs: nothing to copy back
        self.copies = []
        for old, new in vertex.copy_in:
            dst = self.outputs[own[new]]
            src = resolve(TensorRef(old, tuple(dst.shape), tuple(dst.stride()), 0))
            if src.data_ptr() != dst.data_ptr():  # the builder placed new over old: already there
                self.copies.append((dst, src))
        self.op = resolve_op(vertex.op)
        self.skip = vertex.op in UNINITIALIZED and not vertex.copy_in
        self.out_names: tuple[str, ...] = ()
        self.direct = DIRECT.get(vertex.op) if vertex.outputs and vertex.outputs[0] >= 0 else None
        # Reductions to a scalar run functionally and are copied: several of their out= forms
        # (huber_loss, soft_margin_loss, binary_cross_entropy) resize the 0-dim out to the input's
        # shape and write past it, over whatever the arena holds next (tests/test_kernels_out.py).
        scalar_result = bool(self.outputs) and all(o is None or o.dim() == 0 for o in self.outputs)
        variant = out_variant(vertex.op) if writes_in_place(vertex) and not (
            vertex.copy_in or self.skip or self.direct or scalar_result) else None
        if variant is not None:
            self.op, self.out_names = variant
        self.dynamic = bool(scalar_names(vertex.args) or scalar_names(vertex.kwargs))
        self._resolve = resolve_own
        self.args = _materialize(vertex.args, resolve_own, {}) if not self.dynamic else None
        self.kwargs = _materialize(vertex.kwargs, resolve_own, {}) if not self.dynamic else None
        if self.out_names and not self.dynamic:
            self.kwargs.update(self._out_kwargs())

    def _out_kwargs(self) -> dict:
        if self.out_names[0].startswith("*"):  # one out argument taking every output as a list
            return {self.out_names[0][1:]: list(self.outputs)}
        return dict(zip(self.out_names, self.outputs))

    def __call__(self, scalars: Mapping[str, float], rng_state: torch.Tensor | None, device: torch.device) -> None:
        if self.skip:
            return
        for dst, src in self.copies:
            dst.copy_(src)
        args, kwargs = self.args, self.kwargs
        if self.dynamic:
            args = _materialize(self.vertex.args, self._resolve, scalars)
            kwargs = _materialize(self.vertex.kwargs, self._resolve, scalars)
            if self.out_names:
                kwargs.update(self._out_kwargs())
        if self.direct is not None:
            self.direct(self.outputs[0], args, kwargs)
            return
        result = replay(rng_state, device, lambda: self.op(*args, **kwargs))
        if self.out_names or self.in_place:
            return
        flat = flatten_returns(result)
        for out, res in zip(self.outputs, flat):
            if out is not None and res is not None:  # None: an output the kernel leaves undefined (run_vertex)
                out.copy_(res)
