"""Hand-made TaskGraphs and MemGraphs for the engine tests (no tracer, no builder needed).

Every value gets a hand-chosen place; data and memory edges are written out
explicitly, so the tests check the engine alone.
"""

from __future__ import annotations

import torch
from turnip.ir.memgraph import Edge, Kind, MemGraph, Place, Stream
from turnip.ir.plan import Plan
from turnip.ir.taskgraph import TaskGraph, TensorRef, ValueKind

F32 = torch.float32
aten = torch.ops.aten


def dense_stride(shape):
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def add_value(tg: TaskGraph, shape, dtype=F32, kind=ValueKind.INTERMEDIATE, name="") -> int:
    shape = tuple(shape)
    n = 1
    for s in shape:
        n *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    return tg.add_value(shape, dense_stride(shape), dtype, n * itemsize, kind, name=name)


def ref(tg: TaskGraph, vid: int) -> TensorRef:
    return tg.values[vid].dense_ref


class Placer:
    """Bump allocator for hand placement: gpu(v) / cpu(v) give fresh aligned places; reuse by passing a Place."""

    def __init__(self, tg: TaskGraph, alignment: int = 64):
        self.tg, self.align, self.gpu_end, self.cpu_end = tg, alignment, 0, 0

    def _size(self, vid: int) -> int:
        n = self.tg.values[vid].nbytes
        return -(-n // self.align) * self.align

    def gpu(self, vid: int) -> Place:
        p = Place("gpu", self.gpu_end, self._size(vid))
        self.gpu_end += p.nbytes
        return p

    def cpu(self, vid: int) -> Place:
        p = Place("cpu", self.cpu_end, self._size(vid))
        self.cpu_end += p.nbytes
        return p


def new_memgraph(tg: TaskGraph, device: str = "cpu") -> MemGraph:
    return MemGraph(taskgraph=tg, plan=Plan(gpu_budget=0), device=device)


def finish(mg: MemGraph, placer: Placer) -> MemGraph:
    mg.arena_bytes = placer.gpu_end
    mg.cpu_bytes = placer.cpu_end
    if not mg.serial:
        mg.serial = list(range(len(mg.vertices)))
    return mg


# -- the step graph: input, reload, offload, memory reuse, copy into home, outputs --------------------------------

def step_graph(seed: int = 0):
    """A small training-like step with every MVertex kind. Returns (mg, batch_fn, reference).

    h = x @ W; h2 = h + b; y = h2 * h2; loss = sum(y)           (forward)
    g = x^T @ h (h offloaded, reloaded); W <- W - 0.01 g          (COPY into W's arena home)
    s = sum(h2, 0); b <- b - 0.1 s                              (b lives in CPU storage: reload, offload home)
    y reuses h's arena bytes (memory edges from h's readers).
    """
    tg = TaskGraph()
    x = add_value(tg, (4, 8), kind=ValueKind.BATCH, name="batch:x")
    W = add_value(tg, (8, 8), kind=ValueKind.PARAMETER, name="param:W")
    b = add_value(tg, (8,), kind=ValueKind.PARAMETER, name="param:b")
    h = add_value(tg, (4, 8))
    h2 = add_value(tg, (4, 8))
    y = add_value(tg, (4, 8))
    loss = add_value(tg, ())
    g = add_value(tg, (8, 8))
    W_new = add_value(tg, (8, 8))
    s = add_value(tg, (8,))
    b_new = add_value(tg, (8,))
    tg.batch_inputs = [x]
    xT = TensorRef(x, (8, 4), (1, 8), 0)
    t_mm = tg.add_vertex("aten::mm", (ref(tg, x), ref(tg, W)), outputs=(h,), module="lin")
    t_add = tg.add_vertex("aten::add.Tensor", (ref(tg, h), ref(tg, b)), outputs=(h2,), module="lin")
    t_mul = tg.add_vertex("aten::mul.Tensor", (ref(tg, h2), ref(tg, h2)), outputs=(y,), module="sq")
    t_sum = tg.add_vertex("aten::sum.default", (ref(tg, y),), outputs=(loss,), module="loss")
    t_g = tg.add_vertex("aten::mm", (xT, ref(tg, h)), outputs=(g,), phase="backward")
    t_wn = tg.add_vertex("aten::add.Tensor", (ref(tg, W), ref(tg, g)), {"alpha": -0.01}, outputs=(W_new,),
                         phase="optimizer")
    t_s = tg.add_vertex("aten::sum.dim_IntList", (ref(tg, h2), [0]), outputs=(s,), phase="backward")
    t_bn = tg.add_vertex("aten::add.Tensor", (ref(tg, b), ref(tg, s)), {"alpha": -0.1}, outputs=(b_new,),
                         phase="optimizer")
    tg.outputs = {"loss": loss, "h2": h2}
    tg.bindings = {W: W_new, b: b_new}

    mg = new_memgraph(tg)
    P = Placer(tg)
    A_x, A_W, A_b, A_h, A_h2 = P.gpu(x), P.gpu(W), P.gpu(b), P.gpu(h), P.gpu(h2)
    A_y = A_h  # y overwrites h's bytes once h is offloaded and read by h2's add
    A_loss, A_hr, A_g, A_Wn, A_s, A_bn = P.gpu(loss), P.gpu(h), P.gpu(g), P.gpu(W_new), P.gpu(s), P.gpu(b_new)
    C_b, C_h = P.cpu(b), P.cpu(h)
    mg.homes = {W: A_W, b: C_b}
    gen = torch.Generator().manual_seed(seed)
    mg.initial_state = {W: torch.randn(8, 8, generator=gen), b: torch.randn(8, generator=gen)}
    mg.names = {"W": W, "b": b}

    V = mg.add_vertex
    m_in = V(Kind.INPUT, Stream.H2D, value=x, writes={x: A_x})
    m_rb = V(Kind.RELOAD, Stream.H2D, value=b, reads={b: C_b}, writes={b: A_b})
    m_mm = V(Kind.COMPUTE, Stream.COMPUTE, task_vertex=t_mm, reads={x: A_x, W: A_W}, writes={h: A_h})
    m_oh = V(Kind.OFFLOAD, Stream.D2H, value=h, reads={h: A_h}, writes={h: C_h})
    m_add = V(Kind.COMPUTE, Stream.COMPUTE, task_vertex=t_add, reads={h: A_h, b: A_b}, writes={h2: A_h2})
    m_mul = V(Kind.COMPUTE, Stream.COMPUTE, task_vertex=t_mul, reads={h2: A_h2}, writes={y: A_y})
    m_sum = V(Kind.COMPUTE, Stream.COMPUTE, task_vertex=t_sum, reads={y: A_y}, writes={loss: A_loss})
    m_rh = V(Kind.RELOAD, Stream.H2D, value=h, reads={h: C_h}, writes={h: A_hr})
    m_g = V(Kind.COMPUTE, Stream.COMPUTE, task_vertex=t_g, reads={x: A_x, h: A_hr}, writes={g: A_g})
    m_wn = V(Kind.COMPUTE, Stream.COMPUTE, task_vertex=t_wn, reads={W: A_W, g: A_g}, writes={W_new: A_Wn})
    m_cw = V(Kind.COPY, Stream.COMPUTE, value=W_new, reads={W_new: A_Wn}, writes={W: A_W})
    m_s = V(Kind.COMPUTE, Stream.COMPUTE, task_vertex=t_s, reads={h2: A_h2}, writes={s: A_s})
    m_bn = V(Kind.COMPUTE, Stream.COMPUTE, task_vertex=t_bn, reads={b: A_b, s: A_s}, writes={b_new: A_bn})
    m_ob = V(Kind.OFFLOAD, Stream.D2H, value=b_new, reads={b_new: A_bn}, writes={b: C_b})
    m_ol = V(Kind.OUTPUT, Stream.D2H, value=loss, reads={loss: A_loss}, name="loss")
    m_o2 = V(Kind.OUTPUT, Stream.D2H, value=h2, reads={h2: A_h2}, name="h2")
    D, M = Edge.DATA, Edge.MEMORY
    for src, dst in [(m_in, m_mm), (m_in, m_g), (m_rb, m_add), (m_rb, m_bn), (m_mm, m_oh), (m_mm, m_add),
                     (m_add, m_mul), (m_mul, m_sum), (m_oh, m_rh), (m_rh, m_g), (m_g, m_wn), (m_wn, m_cw),
                     (m_add, m_s), (m_s, m_bn), (m_bn, m_ob), (m_sum, m_ol), (m_add, m_o2)]:
        mg.add_edge(src, dst, D)
    # y overwrites h: every reader of h at A_h goes first. W's home is overwritten by the COPY: its readers first.
    # b's CPU home is overwritten by the offload of b_new: the reload of b first.
    for src, dst in [(m_oh, m_mul), (m_add, m_mul), (m_mm, m_cw), (m_rb, m_ob)]:
        mg.add_edge(src, dst, M)
    finish(mg, P)

    def batch_fn(step: int) -> dict:
        return {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 + step))}

    def reference(steps: int) -> tuple[list[dict], dict]:
        """Run the same ops directly; returns per-step outputs and the final weights."""
        Wt, bt = mg.initial_state[W].clone(), mg.initial_state[b].clone()
        outs = []
        for step in range(1, steps + 1):
            xb = batch_fn(step)["x"]
            hh = aten.mm(xb, Wt)
            hh2 = aten.add.Tensor(hh, bt)
            yy = aten.mul.Tensor(hh2, hh2)
            ll = aten.sum.default(yy)
            gg = aten.mm(xb.t(), hh)
            ss = aten.sum.dim_IntList(hh2, [0])
            Wt = aten.add.Tensor(Wt, gg, alpha=-0.01)
            bt = aten.add.Tensor(bt, ss, alpha=-0.1)
            outs.append({"loss": ll, "h2": hh2})
        return outs, {"W": Wt, "b": bt}

    return mg, (lambda step: {"x": batch_fn(step)["x"]}), reference


# -- a wide graph: many independent chains, joined at the end -------------------------------------------------

def wide_graph(chains: int = 6, length: int = 5, n: int = 16, offload_every: int = 2):
    """``chains`` chains of mul/add over (n, n) tensors, some links offloaded and reloaded, summed at the end.

    Lots of vertices are ready at once, so orders really differ between policies and runs.
    Returns (mg, reference_outputs_fn(seed) -> dict, batch(seed) -> dict).
    """
    tg = TaskGraph()
    xs = [add_value(tg, (n, n), kind=ValueKind.BATCH, name=f"batch:x{c}") for c in range(chains)]
    tg.batch_inputs = list(xs)
    mg = new_memgraph(tg)
    P = Placer(tg)
    D = Edge.DATA
    V = mg.add_vertex
    plan_ops = []  # (op, scalar) per link, shared by the reference
    ends = []
    for c in range(chains):
        cur, place = xs[c], P.gpu(xs[c])
        writer = V(Kind.INPUT, Stream.H2D, value=cur, writes={cur: place})
        for i in range(length):
            op = "aten::mul.Tensor" if (c + i) % 2 else "aten::add.Tensor"
            nxt = add_value(tg, (n, n))
            t = tg.add_vertex(op, (ref(tg, cur), ref(tg, cur)), outputs=(nxt,), module=f"chain{c}.{i}")
            nplace = P.gpu(nxt)
            m = V(Kind.COMPUTE, Stream.COMPUTE, task_vertex=t, reads={cur: place}, writes={nxt: nplace})
            mg.add_edge(writer, m, D)
            cur, place, writer = nxt, nplace, m
            if offload_every and i % offload_every == 0:
                cslot, aslot = P.cpu(cur), P.gpu(cur)
                mo = V(Kind.OFFLOAD, Stream.D2H, value=cur, reads={cur: place}, writes={cur: cslot})
                mr = V(Kind.RELOAD, Stream.H2D, value=cur, reads={cur: cslot}, writes={cur: aslot})
                mg.add_edge(writer, mo, D)
                mg.add_edge(mo, mr, D)
                place, writer = aslot, mr
        plan_ops.append(None)
        ends.append((cur, place, writer))
    # join: total = e0 + e1 + ... (a left fold, fixed order)
    acc, aplace, awriter = ends[0]
    for cur, place, writer in ends[1:]:
        nxt = add_value(tg, (n, n))
        t = tg.add_vertex("aten::add.Tensor", (ref(tg, acc), ref(tg, cur)), outputs=(nxt,), module="join")
        nplace = P.gpu(nxt)
        m = V(Kind.COMPUTE, Stream.COMPUTE, task_vertex=t, reads={acc: aplace, cur: place}, writes={nxt: nplace})
        mg.add_edge(awriter, m, D)
        mg.add_edge(writer, m, D)
        acc, aplace, awriter = nxt, nplace, m
    tg.outputs = {"total": acc}
    mo = V(Kind.OUTPUT, Stream.D2H, value=acc, reads={acc: aplace}, name="total")
    mg.add_edge(awriter, mo, D)
    finish(mg, P)

    def batch(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        return {f"x{c}": torch.rand(n, n, generator=gen) for c in range(chains)}

    def reference(seed: int) -> dict:
        b = batch(seed)
        ends_t = []
        for c in range(chains):
            cur = b[f"x{c}"]
            for i in range(length):
                cur = aten.mul.Tensor(cur, cur) if (c + i) % 2 else aten.add.Tensor(cur, cur)
            ends_t.append(cur)
        total = ends_t[0]
        for e in ends_t[1:]:
            total = aten.add.Tensor(total, e)
        return {"total": total}

    return mg, batch, reference
