"""Concatenations written in place: a part of ``cat`` made by an elementwise op just before it is
written by that op straight into its slice of the result.

Llama's rotary embedding concatenates ``-x2`` and ``x1`` (``rotate_half``) for the queries and the
keys of every layer. Eager PyTorch runs ``neg`` into a fresh half-size tensor and then ``cat``, which
reads both halves and writes the whole: at 32K tokens of the 7B shape the 64 ``cat`` kernels take
40 ms and the ``neg`` kernels 12 ms of a 1.37 s prefill (bench/results/h100/prefill_s14.json, kernel
profile). A static plan can do better, as a compiler's "concat in place" does: the result's buffer
exists before the part is made, the elementwise op writes the part into its slice (its ``out=``
overload takes a strided view), and ``cat`` shrinks to copies of the other parts. Every number is the
same kernel's (an elementwise op writes the same value into a strided destination; ``copy_`` and
``cat`` both copy bits), so results stay bitwise equal to eager's.

Expressed with the TaskGraph's in-place form (``Vertex.copy_in``, as trace/donate.py does): an
uninitialized result (``aten::empty_strided``, which runs nothing), then one new version of it per
part written, the last version keeping the ``cat``'s value id so its readers are unchanged. The
builder places each version over the one before (copying only where the order forbids that).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..ir.taskgraph import TaskGraph, TensorRef, Value, ValueKind, Vertex, drop_unproduced
from ..kernels.ops import op_name, out_variant
from .donate import ALIASABLE

log = logging.getLogger(__name__)

CAT = "aten::cat"
# The result's bytes are held from the first part written: only parts made at most this many ops
# before the cat are written in place, so a cat never holds its result much longer than eager does.
NEAR = 4
# Elementwise TensorIterator ops (tests/test_reuse.py checks each bitwise against eager): their out=
# overload writes through any strides, so a slice of the result serves as out.
ELEMENTWISE = frozenset(op for op in ALIASABLE if "softmax" not in op)


@dataclasses.dataclass
class _Concat:
    cat: Vertex
    dim: int
    parts: list[TensorRef]
    offsets: list[int]  # each part's first index along dim
    written: dict[int, int]  # part index -> vertex that writes it in place


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def _find(tg: TaskGraph) -> list[_Concat]:
    consumers = tg.consumers()
    pinned = set(tg.outputs.values()) | set(tg.bindings) | set(tg.bindings.values())
    found = []
    for cat in tg.vertices:
        if cat.op != CAT or cat.copy_in or len(cat.outputs) != 1 or cat.outputs[0] < 0 or not cat.args:
            continue
        result = tg.values[cat.outputs[0]]
        parts = cat.args[0]
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        if (result.kind is not ValueKind.INTERMEDIATE or result.id in pinned or not result.shape
                or tuple(result.stride) != _contiguous_stride(result.shape)
                or not isinstance(parts, (list, tuple)) or not all(isinstance(p, TensorRef) for p in parts)):
            continue
        dim = dim % len(result.shape)
        if any(len(p.size) != len(result.shape) or any(a != b for k, (a, b) in enumerate(zip(p.size, result.shape))
                                                      if k != dim) for p in parts):
            continue  # a legacy empty 1-D part, or a shape cat would reject
        offsets, at = [], 0
        for p in parts:
            offsets.append(at)
            at += p.size[dim]
        if at != result.shape[dim]:
            continue
        written = {}  # each part is a value read once by the cat, so each writer writes one part
        for i, part in enumerate(parts):
            writer = _in_place_writer(tg, consumers, pinned, cat, part)
            if writer is not None:
                written[i] = writer.id
        if written:
            found.append(_Concat(cat, dim, list(parts), offsets, written))
    return found


def _in_place_writer(tg: TaskGraph, consumers, pinned, cat: Vertex, part: TensorRef) -> Vertex | None:
    """The vertex that can write ``part`` straight into the cat's result, or None."""
    value: Value = tg.values[part.value]
    if (value.kind is not ValueKind.INTERMEDIATE or value.id in pinned or part != value.dense_ref
            or value.dtype != tg.values[cat.outputs[0]].dtype  # cat would cast it: the op's own rounding first
            or consumers[value.id] != [cat.id] or sum(r.value == value.id for r in cat.refs()) != 1
            or value.producer < 0 or cat.id - value.producer > NEAR):
        return None
    writer = tg.vertices[value.producer]
    if (writer.op not in ELEMENTWISE or writer.copy_in or writer.random or writer.recompute_of >= 0
            or tuple(writer.outputs) != (value.id,) or writer.phase != cat.phase):
        return None
    variant = out_variant(writer.op)
    return writer if variant is not None and len(variant[1]) == 1 else None


def write_concats_in_place(tg: TaskGraph) -> TaskGraph:
    """``tg`` with every cat that has a part made just before it by an elementwise op rewritten as
    the module docstring says (a new graph; ``tg`` itself is left as it is when nothing matches)."""
    concats = _find(tg)
    if not concats:
        return tg
    out = dataclasses.replace(tg, vertices=[], values=[dataclasses.replace(v) for v in tg.values],
                              outputs=dict(tg.outputs), bindings=dict(tg.bindings))
    start_at: dict[int, _Concat] = {}  # first writer in program order -> its concat: the empty result goes first
    rewrite: dict[int, tuple[_Concat, int]] = {}  # writer vertex -> (concat, part)
    at_cat: dict[int, _Concat] = {}
    for c in concats:
        start_at[min(c.written.values())] = c
        for part, vid in c.written.items():
            rewrite[vid] = (c, part)
        at_cat[c.cat.id] = c
    versions: dict[int, int] = {}  # cat vertex -> the value id of the result's latest version
    remaining: dict[int, int] = {c.cat.id: len(c.parts) for c in concats}  # versions still to write

    def next_version(c: _Concat) -> tuple[int, int]:
        """(old, new) value ids of the cat's result around one more part written."""
        old = versions[c.cat.id]
        remaining[c.cat.id] -= 1
        if remaining[c.cat.id] == 0:
            new = c.cat.outputs[0]  # the last version is the cat's value: its readers stay as they are
        else:
            like = tg.values[c.cat.outputs[0]]
            new = out.add_value(like.shape, like.stride, like.dtype, like.nbytes)
        versions[c.cat.id] = new
        return old, new

    def slice_of(c: _Concat, part: int, value: int) -> TensorRef:
        result = tg.values[c.cat.outputs[0]]
        return TensorRef(value, tuple(c.parts[part].size), tuple(result.stride), c.offsets[part] * result.stride[c.dim])

    for vertex in tg.vertices:
        c = start_at.get(vertex.id)
        if c is not None:
            result = tg.values[c.cat.outputs[0]]
            empty = out.add_value(result.shape, result.stride, result.dtype, result.nbytes)
            out.add_vertex(op_name(torch.ops.aten.empty_strided.default), (list(result.shape), list(result.stride)),
                           {"dtype": result.dtype, "device": torch.device(tg.device)}, (empty,),
                           module=c.cat.module, phase=c.cat.phase, device=c.cat.device)
            versions[c.cat.id] = empty
        if vertex.id in rewrite:
            c, part = rewrite[vertex.id]
            old, new = next_version(c)
            out_op, (out_name,) = out_variant(vertex.op)
            out.add_copy(vertex, op=op_name(out_op), kwargs={**vertex.kwargs, out_name: slice_of(c, part, new)},
                         outputs=(new,), copy_in=((old, new),))
            continue
        if vertex.id in at_cat:
            c = at_cat[vertex.id]
            for part, ref in enumerate(c.parts):
                if part in c.written:
                    continue
                old, new = next_version(c)
                out.add_vertex(op_name(torch.ops.aten.copy_.default), (slice_of(c, part, new), ref), {}, (new,),
                               module=vertex.module, phase=vertex.phase, copy_in=((old, new),), device=vertex.device)
            continue
        out.add_copy(vertex)
    out = drop_unproduced(out)
    out.validate()
    log.info("%d concatenations written in place (%d parts written by the op that makes them)", len(concats),
             sum(len(c.written) for c in concats))
    return out
