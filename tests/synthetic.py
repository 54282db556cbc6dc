"""Synthetic TaskGraphs and Plans for tests and benchmarks (no torch needed).

- `random_taskgraph`: a random training-step-shaped DAG: batch and persistent
  inputs, a forward part with skip connections and multi-output ops, a
  backward part reading saved activations in reverse, optimizer updates bound
  back to parameters and states, a "loss" output; tensor sizes log-uniform
  over three orders of magnitude.
- `chain_of_blocks`: a long regular forward/backward/optimizer chain (the
  build-time benchmark's graph).
- `random_plan`: a Plan over a TaskGraph with a random valid order,
  recomputation, planned offloads and CPU homes.
- `unconstrained_budget`: a GPU budget at which nothing ever needs evicting.

Vertices use op "synthetic"; args are TensorRef(value.dense_ref) of their inputs.
"""

from __future__ import annotations

import math
import random

from turnip.ir.plan import CPU, Plan, Recompute
from turnip.ir.taskgraph import TaskGraph, ValueKind

PERSISTENT = (ValueKind.PARAMETER, ValueKind.FROZEN, ValueKind.OPTIMIZER_STATE, ValueKind.CONSTANT)


def _value(tg: TaskGraph, nbytes: int, kind=ValueKind.INTERMEDIATE, name="") -> int:
    n = max(1, nbytes // 4)
    return tg.add_value((n,), (1,), "float32", nbytes, kind, name=name)


def _vertex(tg: TaskGraph, inputs, outputs, phase="forward", module="", workspace=0, copy_in=()) -> int:
    """copy_in: (old, new) pairs of an in-place op (new is old updated; the builder may put new over old)."""
    args = tuple(tg.values[x].dense_ref for x in inputs)
    return tg.add_vertex("synthetic", args, outputs=tuple(outputs), phase=phase, module=module, workspace=workspace,
                         copy_in=tuple(copy_in))


def random_taskgraph(rng: random.Random, n_vertices: int = 60, *, min_bytes: int = 64, max_bytes: int = 64_000,
                     n_params: int | None = None, p_multi: float = 0.15, p_skip: float = 0.2,
                     p_workspace: float = 0.1, p_in_place: float = 0.0) -> TaskGraph:
    """A random step of about ``n_vertices`` vertices (at least the optimizer's). With probability
    ``p_in_place`` a forward op updates the latest activation in place (whether anything reads the
    old version later is up to chance), and an optimizer update writes its parameter or state in place."""
    tg = TaskGraph()

    def size() -> int:
        return int(math.exp(rng.uniform(math.log(min_bytes), math.log(max_bytes))))

    n_params = n_params if n_params is not None else max(1, n_vertices // 15)
    batch = [_value(tg, size(), ValueKind.BATCH, f"batch:{i}") for i in range(rng.randint(1, 3))]
    params = [_value(tg, size(), ValueKind.PARAMETER, f"param:{i}") for i in range(n_params)]
    frozen = [_value(tg, size(), rng.choice([ValueKind.FROZEN, ValueKind.CONSTANT]), f"frozen:{i}")
              for i in range(rng.randint(0, 2))]
    states = {p: _value(tg, tg.values[p].nbytes, ValueKind.OPTIMIZER_STATE, f"state:{p}")
              for p in params if rng.random() < 0.5}
    n_opt = sum(2 if p in states else 1 for p in params)
    budget = max(4, n_vertices - n_opt)
    n_fwd = max(2, budget * 3 // 5)
    n_bwd = max(1, budget - n_fwd)

    def ws() -> int:
        return size() if rng.random() < p_workspace else 0

    # forward: each op reads the latest activation, sometimes an older one, a parameter or a batch value
    acts: list[int] = []
    for i in range(n_fwd):
        ins = [acts[-1]] if acts else [rng.choice(batch)]
        if acts and rng.random() < p_skip:
            ins.append(rng.choice(acts))
        if rng.random() < 0.5:
            ins.append(rng.choice(params + frozen))
        if rng.random() < 0.1:
            ins.append(rng.choice(batch))
        if acts and rng.random() < p_in_place:  # e.g. relu_: the new version has the old one's size
            old = acts[-1]
            outs = [_value(tg, tg.values[old].nbytes)]
            _vertex(tg, list(dict.fromkeys(ins)), outs, "forward", f"block.{i // 4}", ws(), copy_in=[(old, outs[0])])
            acts.append(outs[0])
            continue
        outs = [_value(tg, size())]
        if rng.random() < p_multi:
            outs.append(_value(tg, size()) if rng.random() < 0.7 else -1)
        _vertex(tg, list(dict.fromkeys(ins)), outs, "forward", f"block.{i // 4}", ws())
        acts.extend(o for o in outs if o >= 0)
    loss = acts[-1]
    tg.outputs["loss"] = loss
    if rng.random() < 0.3 and len(acts) > 2:
        tg.outputs["aux"] = rng.choice(acts[:-1])

    # backward: walk saved activations in reverse, producing gradients
    grad = _value(tg, size())
    _vertex(tg, [loss], [grad], "backward")
    grads = [grad]
    saved = list(reversed(acts))
    for i in range(n_bwd - 1):
        ins = [grads[-1], saved[min(i, len(saved) - 1)]]
        if rng.random() < 0.3:
            ins.append(rng.choice(params + frozen))
        if rng.random() < p_skip:
            ins.append(rng.choice(saved))
        outs = [_value(tg, size())]
        if rng.random() < p_multi:
            outs.append(_value(tg, size()))
        _vertex(tg, list(dict.fromkeys(ins)), outs, "backward", workspace=ws())
        grads.extend(outs)

    # optimizer: each parameter (and its state) is updated from some gradient and bound back
    def in_place(old: int, new: int) -> list:
        return [(old, new)] if rng.random() < p_in_place else []

    for p in params:
        g = rng.choice(grads)
        if p in states:
            s = states[p]
            new_s = _value(tg, tg.values[s].nbytes)
            _vertex(tg, [s, g], [new_s], "optimizer", copy_in=in_place(s, new_s))
            new_p = _value(tg, tg.values[p].nbytes)
            _vertex(tg, [p, new_s], [new_p], "optimizer", copy_in=in_place(p, new_p))
            tg.bindings[s] = new_s
        else:
            new_p = _value(tg, tg.values[p].nbytes)
            _vertex(tg, [p, g], [new_p], "optimizer", copy_in=in_place(p, new_p))
        tg.bindings[p] = new_p
    tg.validate()
    return tg


def chain_of_blocks(n_blocks: int, *, act_bytes: int = 1 << 20, param_bytes: int = 1 << 17,
                    seed: int = 0, in_place: bool = False) -> TaskGraph:
    """A transformer-like chain: per block 4 forward ops (2 weights), 6 backward ops, 2 SGD updates:
    12 vertices per block. Sizes jitter by up to 2x so the arena fragments like a real one."""
    rng = random.Random(seed)
    tg = TaskGraph()

    def jitter(n: int) -> int:
        return int(n * rng.uniform(0.5, 1.0))

    x = _value(tg, act_bytes, ValueKind.BATCH, "batch:0")
    weights, saved = [], []
    for b in range(n_blocks):
        w1 = _value(tg, jitter(param_bytes), ValueKind.PARAMETER, f"param:{b}.w1")
        w2 = _value(tg, jitter(param_bytes), ValueKind.PARAMETER, f"param:{b}.w2")
        mod = f"blocks.{b}"
        h1 = _value(tg, jitter(act_bytes))
        _vertex(tg, [x, w1], [h1], "forward", mod)
        h2 = _value(tg, jitter(act_bytes))
        _vertex(tg, [h1], [h2], "forward", mod)
        h3 = _value(tg, jitter(act_bytes))
        _vertex(tg, [h2, w2], [h3], "forward", mod)
        y = _value(tg, act_bytes)
        _vertex(tg, [x, h3], [y], "forward", mod)
        weights.append((w1, w2))
        saved.append((x, h1, h2))
        x = y
    tg.outputs["loss"] = x
    grad = x
    grads_w = []
    for b in reversed(range(n_blocks)):
        w1, w2 = weights[b]
        xin, h1, h2 = saved[b]
        mod = f"blocks.{b}"
        g3 = _value(tg, act_bytes)
        _vertex(tg, [grad], [g3], "backward", mod)
        gw2 = _value(tg, tg.values[w2].nbytes)
        _vertex(tg, [g3, h2], [gw2], "backward", mod)
        g2 = _value(tg, act_bytes)
        _vertex(tg, [g3, w2], [g2], "backward", mod)
        g1 = _value(tg, act_bytes)
        _vertex(tg, [g2, h1], [g1], "backward", mod)
        gw1 = _value(tg, tg.values[w1].nbytes)
        _vertex(tg, [g1, xin], [gw1], "backward", mod)
        gx = _value(tg, act_bytes)
        _vertex(tg, [g1, w1, grad], [gx], "backward", mod)
        grads_w.append((w1, gw1))
        grads_w.append((w2, gw2))
        grad = gx
    for w, gw in grads_w:
        new_w = _value(tg, tg.values[w].nbytes)
        _vertex(tg, [w, gw], [new_w], "optimizer", copy_in=[(w, new_w)] if in_place else [])
        tg.bindings[w] = new_w
    return tg


def random_topological_order(rng: random.Random, tg: TaskGraph, locality: float = 0.8) -> list[int]:
    """A random valid order: with probability ``locality`` the earliest ready vertex, else any ready one."""
    n = len(tg.vertices)
    indeg = [0] * n
    succ: list[set[int]] = [set() for _ in range(n)]
    for vertex in tg.vertices:
        for x in vertex.inputs():
            p = tg.values[x].producer
            if tg.values[x].kind is ValueKind.INTERMEDIATE and p >= 0 and vertex.id not in succ[p]:
                succ[p].add(vertex.id)
                indeg[vertex.id] += 1
    ready = sorted(v for v in range(n) if indeg[v] == 0)
    order = []
    while ready:
        k = 0 if rng.random() < locality else rng.randrange(len(ready))
        v = ready.pop(k)
        order.append(v)
        for w in succ[v]:
            indeg[w] -= 1
            if indeg[w] == 0:
                ready.append(w)
        ready.sort()
    return order


def random_plan(rng: random.Random, tg: TaskGraph, gpu_budget: int = 1 << 40, *, cpu_budget: int | None = None,
                p_offload: float = 0.15, p_cpu_home: float = 0.3, n_recompute: int = 3,
                shuffle: bool = True) -> Plan:
    """A plan exercising every decision a planner can make."""
    order = random_topological_order(rng, tg) if shuffle and rng.random() < 0.6 else list(range(len(tg.vertices)))
    pos = {v: k for k, v in enumerate(order)}
    consumers = tg.consumers()
    recompute = []
    forward = [v.id for v in tg.vertices if v.phase == "forward"]
    for _ in range(n_recompute if forward else 0):
        v = rng.choice(forward)
        later = [c for o in tg.vertices[v].outputs if o >= 0 for c in consumers[o] if pos[c] > pos[v] + 1]
        if later:
            recompute.append(Recompute(v, rng.choice(later)))
    # copies scheduled before the same vertex run in list order; keep each chain in program order
    recompute.sort(key=lambda r: (pos[r.before], pos[r.vertex]))
    recompute = list(dict.fromkeys(recompute))
    offload = {v.id for v in tg.values if v.kind is ValueKind.INTERMEDIATE and rng.random() < p_offload}
    home = {v.id: CPU for v in tg.values if v.kind in PERSISTENT and rng.random() < p_cpu_home}
    return Plan(gpu_budget=gpu_budget, cpu_budget=cpu_budget, order=order, recompute=recompute,
                offload=offload, home=home, planner="synthetic")


def unconstrained_budget(tg: TaskGraph, plan: Plan | None = None, alignment: int = 256) -> int:
    """Every value (recomputed copies included) in bytes of its own, plus workspace: nothing is ever evicted."""
    if plan is not None:
        tg = plan.expand(tg)[0]
    total = sum(-(-max(v.nbytes, 1) // alignment) * alignment for v in tg.values)
    return total + max((v.workspace for v in tg.vertices), default=0) + alignment
