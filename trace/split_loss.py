"""Split the language-model loss head into row blocks, so no op holds all the logits.

The largest op of a language model's step is its loss head: the LM head matmul, the (fp32)
log-softmax over the whole vocabulary and the NLL loss, and in the backward their gradients; on
gpt350m one of them needs more than 3.8 GiB, which sets the smallest budget the step can run in.
``split_loss_head(tg, k)`` rewrites that head of a traced step (before buffer donation) into k
blocks of rows (tokens):

    forward, per block c:  y_c = h_c @ Wt  ->  [cast]  ->  log_softmax  ->  [cast]  ->  nll_loss (sum) -> s_c, w_c
                           loss = (s_0 + ... + s_k-1) / (w_0 + ... + w_k-1)     (reduction "mean")
    backward, per block c: nll_loss_backward(g, L_c, t_c, total_weight) -> [cast] -> log_softmax backward
                           -> [cast] -> dh_c = gy_c @ W,  dW += gy_c^T @ h_c
                           dh = cat(dh_0, ..., dh_k-1)

Each block is a value of its own, so the planner keeps, offloads or recomputes blocks separately,
and the largest op shrinks by k. Per-row results are computed by the same kernels on fewer rows;
the loss's sum, the total weight and the weight gradient (a sum over rows) are added block by
block, in another order than eager's single kernels, and under bf16 autocast each block's weight
gradient is rounded to bf16 before the fp32 sum: the step is then equal to eager within float
tolerance, not bitwise (tests/test_split.py states the tolerance). The head is recognized by its
shape at the ATen level (mm, _log_softmax over the last dim with an optional cast before it (autocast
on the CPU) or after it (autocast on CUDA), nll_loss_forward without class weights, and their
backward ops with no other readers); a step without one is left alone.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from ..ir.taskgraph import TaskGraph, TensorRef, Vertex, drop_unproduced

log = logging.getLogger(__name__)

REDUCTION_MEAN, REDUCTION_SUM = 1, 2  # torch's Reduction enum, as nll_loss takes it


@dataclass
class LossHead:
    """The vertices of a recognized loss head (ids in the TaskGraph) and the refs it reads. Autocast
    puts its fp32 cast before the log-softmax on the CPU (``cast_in``) and between the log-softmax
    and the NLL loss on CUDA (``cast_out``); each forward cast has its backward twin."""

    mm: int
    cast_in: int | None  # y -> fp32 before the log-softmax, or None
    log_softmax: int
    cast_out: int | None  # log-probabilities -> fp32 before the NLL loss, or None
    nll: int
    nll_backward: int
    cast_out_backward: int | None  # the NLL gradient -> the log-probabilities' dtype, or None
    log_softmax_backward: int
    cast_in_backward: int | None  # gx -> y's dtype, or None
    mm_weight: int  # dWt = gy^T @ h
    mm_input: int  # dh = gy @ W
    rows: int
    vocab: int


def _only_readers(tg: TaskGraph, readers: list[list[int]], value: int, allowed: set[int]) -> bool:
    return set(readers[value]) <= allowed and value not in tg.outputs.values()


def find_loss_head(tg: TaskGraph) -> LossHead | None:
    """The first loss head of ``tg`` (see the module docstring), or None."""
    heads = find_loss_heads(tg)
    return heads[0] if heads else None


def find_loss_heads(tg: TaskGraph) -> list[LossHead]:
    """Every loss head of ``tg``: one per micro-batch of a step that accumulates gradients."""
    readers = tg.consumers()
    heads = []
    for nll in tg.vertices:
        if nll.op != "aten::nll_loss_forward" or nll.args[2] is not None or nll.args[3] not in (REDUCTION_MEAN,
                                                                                              REDUCTION_SUM):
            continue
        head = _match(tg, nll, readers)
        if head is not None:
            heads.append(head)
    return heads


def _made_by(tg: TaskGraph, value: int) -> Vertex | None:
    producer = tg.values[value].producer
    return tg.vertices[producer] if producer >= 0 else None


def _match(tg: TaskGraph, nll: Vertex, readers) -> LossHead | None:
    nll_in, target_ref = nll.args[0], nll.args[1]
    if not (isinstance(nll_in, TensorRef) and len(nll_in.size) == 2 and isinstance(target_ref, TensorRef)):
        return None
    rows, vocab = nll_in.size
    ls = _made_by(tg, nll_in.value)
    cast_out = None
    if ls is not None and ls.op == "aten::_to_copy":
        cast_out, ls = ls, _made_by(tg, ls.args[0].value)
    if ls is None or ls.op != "aten::_log_softmax" or ls.args[1] not in (1, -1) or ls.args[2]:
        return None
    x_ref = ls.args[0]
    before = _made_by(tg, x_ref.value)
    cast_in = None
    if before is not None and before.op == "aten::_to_copy":
        cast_in, before = before, _made_by(tg, before.args[0].value)
    if before is None or before.op != "aten::mm":
        return None
    mm = before
    h_ref, wt_ref = mm.args[0], mm.args[1]
    if h_ref.size != (rows, h_ref.size[1]) or wt_ref.size[1] != vocab or tuple(tg.values[mm.outputs[0]].shape) != (rows, vocab):
        return None
    # the backward: nll_loss_backward -> [cast] -> _log_softmax_backward_data -> [cast] -> the two matmuls
    total_weight, logp = nll.outputs[1], ls.outputs[0]
    nb = _only_reader(tg, readers, nll_in.value, "aten::nll_loss_backward")
    lb = _only_reader(tg, readers, logp, "aten::_log_softmax_backward_data")
    if nb is None or lb is None:
        return None
    if nb.args[1].value != nll_in.value or nb.args[6].value != total_weight or nb.args[2] != target_ref \
            or nb.args[3:6] != nll.args[2:5]:
        return None
    past = _past_backward_cast(tg, readers, nb.outputs[0], cast_out)
    if past is None:
        return None
    g_logp, cast_out_backward = past
    if lb.args[0].value != g_logp or lb.args[1].value != logp:
        return None
    past = _past_backward_cast(tg, readers, lb.outputs[0], cast_in)
    if past is None:
        return None
    gy, cast_in_backward = past
    mms = [tg.vertices[r] for r in readers[gy]]
    if len(mms) != 2 or any(v.op != "aten::mm" for v in mms):
        return None
    by_first = {tuple(v.args[0].size): v for v in mms}
    mm_weight, mm_input = by_first.get((vocab, rows)), by_first.get((rows, vocab))
    if mm_weight is None or mm_input is None or mm_weight.args[1] != h_ref or mm_input.args[0].size != (rows, vocab):
        return None
    casts = [c for c in (cast_in, cast_out, cast_out_backward, cast_in_backward) if c is not None]
    chain = {mm.id, ls.id, nll.id, nb.id, lb.id, mm_weight.id, mm_input.id} | {c.id for c in casts}
    # the head's intermediates are read by the head alone, so removing it loses nothing
    private = [mm.outputs[0], logp, nb.outputs[0], lb.outputs[0]] + [c.outputs[0] for c in casts]
    if not all(_only_readers(tg, readers, value, chain) for value in private):
        return None
    ids = [c.id if c is not None else None for c in (cast_in, cast_out, cast_out_backward, cast_in_backward)]
    return LossHead(mm.id, ids[0], ls.id, ids[1], nll.id, nb.id, ids[2], lb.id, ids[3], mm_weight.id, mm_input.id,
                    rows, vocab)


def _only_reader(tg: TaskGraph, readers, value: int, op: str) -> Vertex | None:
    """The one reader of ``value`` running ``op`` (others may read it too), or None."""
    found = [tg.vertices[r] for r in readers[value] if tg.vertices[r].op == op]
    return found[0] if len(found) == 1 else None


def _past_backward_cast(tg: TaskGraph, readers, gradient: int, forward_cast: Vertex | None
                        ) -> tuple[int, Vertex | None] | None:
    """(the gradient past the backward twin of ``forward_cast``, that twin): the gradient itself
    where the forward had no cast; None where the twin (the gradient's sole reader, a cast) is missing."""
    if forward_cast is None:
        return gradient, None
    twin = _sole_reader(tg, readers, gradient, "aten::_to_copy")
    return (twin.outputs[0], twin) if twin is not None else None


def _sole_reader(tg: TaskGraph, readers, value: int, op: str) -> Vertex | None:
    """The reader of ``value`` when it has exactly one and it runs ``op``, else None."""
    found = [tg.vertices[r] for r in readers[value]]
    return found[0] if len(found) == 1 and found[0].op == op else None


def _rows(ref: TensorRef, start: int, stop: int) -> TensorRef:
    return TensorRef(ref.value, (stop - start, *ref.size[1:]), ref.stride, ref.storage_offset + start * ref.stride[0])


def _bounds(rows: int, k: int) -> list[tuple[int, int]]:
    step = -(-rows // k)
    return [(a, min(rows, a + step)) for a in range(0, rows, step)]


class _Writer:
    """Appends vertices and values to a graph under construction."""

    def __init__(self, tg: TaskGraph):
        self.tg = tg

    def value(self, shape, dtype) -> int:
        meta = torch.empty(shape, dtype=dtype, device="meta")
        return self.tg.add_value(meta.shape, meta.stride(), dtype, meta.untyped_storage().nbytes())

    def dense(self, vid: int) -> TensorRef:
        return self.tg.values[vid].dense_ref

    def op(self, like: Vertex, op: str, args, kwargs=None, outputs=()) -> None:
        self.tg.add_vertex(op, tuple(args), dict(kwargs or {}), tuple(outputs), module=like.module, phase=like.phase,
                           device=like.device)


def split_loss_head(tg: TaskGraph, k: int) -> TaskGraph:
    """``tg`` with each loss head in ``k`` row blocks (a new graph; ``tg`` is left as it is). A step
    without a recognizable head, or k < 2, comes back unchanged."""
    heads = [h for h in find_loss_heads(tg) if len(_bounds(h.rows, k)) >= 2] if k >= 2 else []
    if not heads:
        return tg
    out = dataclasses.replace(tg, vertices=[], values=[dataclasses.replace(val) for val in tg.values],
                              outputs=dict(tg.outputs), bindings=dict(tg.bindings))
    rewrites = [_HeadRewrite(tg, head, _bounds(head.rows, k), _Writer(out)) for head in heads]
    forward_at = {r.forward_at: r for r in rewrites}
    backward_at = {r.backward_at: r for r in rewrites}
    removed = set().union(*(r.removed for r in rewrites))
    keep = set().union(*(r.results for r in rewrites))
    for vertex in tg.vertices:
        if vertex.id in forward_at:
            forward_at[vertex.id].forward()
        if vertex.id not in removed:
            out.add_copy(vertex)
        if vertex.id in backward_at:
            backward_at[vertex.id].backward()
    out = drop_unproduced(out, keep=keep)
    out.validate()
    for head in heads:
        log.info("split a loss head (%d x %d logits) into %d row blocks", head.rows, head.vocab,
                 len(_bounds(head.rows, k)))
    return out


class _HeadRewrite:
    """One loss head's blocks: ``forward()`` where its NLL loss was, ``backward()`` where its last
    gradient matmul was; the loss, total weight and both gradients keep their value ids."""

    def __init__(self, tg: TaskGraph, head: LossHead, blocks: list[tuple[int, int]], writer: _Writer):
        v = tg.vertices

        def vertex(vid: int | None) -> Vertex | None:
            return v[vid] if vid is not None else None

        self.tg, self.head, self.blocks, self.w = tg, head, blocks, writer
        self.mm, self.ls, self.nll = v[head.mm], v[head.log_softmax], v[head.nll]
        self.cast_in, self.cast_out = vertex(head.cast_in), vertex(head.cast_out)
        self.nb, self.lb = v[head.nll_backward], v[head.log_softmax_backward]
        self.cast_out_b, self.cast_in_b = vertex(head.cast_out_backward), vertex(head.cast_in_backward)
        self.mm_w, self.mm_h = v[head.mm_weight], v[head.mm_input]
        self.removed = {x.id for x in (self.mm, self.cast_in, self.ls, self.cast_out, self.nll, self.nb,
                                       self.cast_out_b, self.lb, self.cast_in_b, self.mm_w, self.mm_h) if x is not None}
        self.forward_at, self.backward_at = self.nll.id, max(self.mm_w.id, self.mm_h.id)
        self.h_ref, self.wt_ref, self.target_ref = self.mm.args[0], self.mm.args[1], self.nll.args[1]

        def dtype(x: Vertex) -> torch.dtype:
            return tg.values[x.outputs[0]].dtype

        self.y_dtype = dtype(self.mm)  # the matmul's
        self.x_dtype = dtype(self.cast_in) if self.cast_in is not None else self.y_dtype  # the log-softmax's
        self.l_dtype = dtype(self.cast_out) if self.cast_out is not None else self.x_dtype  # the NLL loss's
        self.results = {*self.nll.outputs, self.mm_w.outputs[0], self.mm_h.outputs[0]}
        self.logps: list[int] = []  # per block: the log-softmax's result, which its backward reads
        self.nll_ins: list[int] = []  # per block: what the NLL loss read (logp, or its fp32 cast)

    def _cast(self, like: Vertex | None, value: int, shape: tuple, dtype: torch.dtype) -> int:
        """``value`` through the cast vertex ``like`` (a new value), or ``value`` itself without one."""
        if like is None:
            return value
        out = self.w.value(shape, dtype)
        self.w.op(like, "aten::_to_copy", (self.w.dense(value),), like.kwargs, outputs=(out,))
        return out

    def forward(self) -> None:
        w, head, nll = self.w, self.head, self.nll
        reduction, ignore_index = nll.args[3], nll.args[4]
        loss, total_weight = nll.outputs
        sums, weights = [], []
        for a, b in self.blocks:
            shape = (b - a, head.vocab)
            y = w.value(shape, self.y_dtype)
            w.op(self.mm, "aten::mm", (_rows(self.h_ref, a, b), self.wt_ref), outputs=(y,))
            x = self._cast(self.cast_in, y, shape, self.x_dtype)
            logp = w.value(shape, self.x_dtype)
            w.op(self.ls, "aten::_log_softmax", (w.dense(x), *self.ls.args[1:]), outputs=(logp,))
            self.logps.append(logp)
            nll_in = self._cast(self.cast_out, logp, shape, self.l_dtype)
            self.nll_ins.append(nll_in)
            s, t = w.value((), self.l_dtype), w.value((), self.l_dtype)
            w.op(nll, "aten::nll_loss_forward", (w.dense(nll_in), _rows(self.target_ref, a, b), None, REDUCTION_SUM,
                                                 ignore_index), outputs=(s, t))
            sums.append(s)
            weights.append(t)
        _sum_into(w, nll, weights, total_weight)
        if reduction == REDUCTION_MEAN:
            total = w.value((), self.l_dtype)
            _sum_into(w, nll, sums, total)
            w.op(nll, "aten::div.Tensor", (w.dense(total), w.dense(total_weight)), outputs=(loss,))
        else:
            _sum_into(w, nll, sums, loss)

    def backward(self) -> None:
        w, head, nb, lb, mm_w, mm_h = self.w, self.head, self.nb, self.lb, self.mm_w, self.mm_h
        dh_blocks, acc = [], None
        dw_value = mm_w.outputs[0]
        dw_shape, dw_dtype = tuple(self.tg.values[dw_value].shape), self.tg.values[dw_value].dtype
        acc_dtype = torch.float32 if dw_dtype in (torch.bfloat16, torch.float16) else dw_dtype
        blocks = zip(self.blocks, self.logps, self.nll_ins, strict=True)
        for c, ((a, b), logp, nll_in) in enumerate(blocks):
            n = b - a
            shape = (n, head.vocab)
            last = c == len(self.blocks) - 1
            g_nll_in = w.value(shape, self.l_dtype)
            w.op(nb, "aten::nll_loss_backward", (nb.args[0], w.dense(nll_in), _rows(self.target_ref, a, b),
                                                 *nb.args[3:6], nb.args[6]), outputs=(g_nll_in,))
            g_logp = self._cast(self.cast_out_b, g_nll_in, shape, self.x_dtype)
            gx = w.value(shape, self.x_dtype)
            w.op(lb, "aten::_log_softmax_backward_data", (w.dense(g_logp), w.dense(logp), *lb.args[2:]),
                 outputs=(gx,))
            gy = self._cast(self.cast_in_b, gx, shape, self.y_dtype)
            dh = w.value((n, mm_h.args[1].size[1]), self.tg.values[mm_h.outputs[0]].dtype)
            w.op(mm_h, "aten::mm", (w.dense(gy), mm_h.args[1]), outputs=(dh,))
            dh_blocks.append(dh)
            gy_t = TensorRef(gy, (head.vocab, n), (1, head.vocab), 0)
            part = w.value(dw_shape, dw_dtype)
            w.op(mm_w, "aten::mm", (gy_t, _rows(self.h_ref, a, b)), outputs=(part,))
            if acc_dtype != dw_dtype:  # bf16 blocks are summed in fp32
                wide = w.value(dw_shape, acc_dtype)
                w.op(mm_w, "aten::_to_copy", (w.dense(part),), {"dtype": acc_dtype}, outputs=(wide,))
                part = wide
            if acc is None:
                acc = part
            else:  # the last sum is the gradient itself where no cast back follows
                total = dw_value if last and acc_dtype == dw_dtype else w.value(dw_shape, acc_dtype)
                w.op(mm_w, "aten::add.Tensor", (w.dense(acc), w.dense(part)), outputs=(total,))
                acc = total
        if acc_dtype != dw_dtype:
            w.op(mm_w, "aten::_to_copy", (w.dense(acc),), {"dtype": dw_dtype}, outputs=(dw_value,))
        w.op(mm_h, "aten::cat", ([w.dense(d) for d in dh_blocks],), outputs=(mm_h.outputs[0],))


def _sum_into(w: _Writer, like: Vertex, parts: list[int], target: int) -> None:
    """target = parts[0] + parts[1] + ..., added in order (the last add writes target)."""
    acc = parts[0]
    for i, part in enumerate(parts[1:], start=1):
        dst = target if i == len(parts) - 1 else w.value((), w.tg.values[acc].dtype)
        w.op(like, "aten::add.Tensor", (w.dense(acc), w.dense(part)), outputs=(dst,))
        acc = dst
    if len(parts) == 1:
        w.op(like, "aten::clone", (w.dense(acc),), outputs=(target,))


