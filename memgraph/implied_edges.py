"""Drop memory edges that other edges already imply (a cheap, partial transitive reduction).

A memory edge u -> w is redundant when u is an ancestor of another
predecessor of w: the partial order, hence every order the engine may pick,
is unchanged without it. Full transitive reduction is quadratic; here
ancestry is proven two cheap ways:
- interval labels of a spanning tree (each vertex's latest predecessor is
  its tree parent, so the long chains of a training step are tree paths):
  "u is a tree ancestor of x" is an O(1) test;
- u is a direct predecessor of another predecessor of w (two hops).
What is proven is exact; what these miss is kept. Removing an implied
edge keeps the transitive closure, so later tests stay valid. Data edges are
never dropped: they say where each input comes from.
"""

from __future__ import annotations


def reduce_memory_edges(n: int, data: set[tuple[int, int]],
                        memory: set[tuple[int, int]]) -> tuple[set[tuple[int, int]], int]:
    """Vertices are numbered in serial order (every edge goes from a smaller id to a larger one).
    Return (memory edges kept, number dropped); memory edges duplicating a data edge count as dropped."""
    preds: list[list[int]] = [[] for _ in range(n)]
    for s, d in data:
        preds[d].append(s)
    mem_in: list[list[int]] = [[] for _ in range(n)]
    dropped = 0
    for s, d in memory:
        if (s, d) in data:
            dropped += 1
            continue
        mem_in[d].append(s)
        preds[d].append(s)
    enter, leave = _tree_intervals(n, preds)

    kept: set[tuple[int, int]] = set()
    for w in range(n):
        mine = mem_in[w]
        if not mine:
            continue
        ps = preds[w]
        if len(ps) > 1:
            redundant = set()
            for u in mine:
                eu, lu = enter[u], leave[u]
                for p in ps:
                    # u reaches another predecessor p: along tree edges, or directly
                    if p != u and ((eu < enter[p] and leave[p] <= lu) or u in preds[p]):
                        redundant.add(u)
                        break
            if redundant:
                dropped += len(redundant)
                preds[w] = [p for p in ps if p not in redundant]
                mine = [u for u in mine if u not in redundant]
        kept.update((u, w) for u in mine)
    return kept, dropped


def _tree_intervals(n: int, preds: list[list[int]]) -> tuple[list[int], list[int]]:
    """Pre/post numbers of the spanning forest where each vertex hangs under its latest predecessor:
    x is a tree descendant of u iff enter[u] < enter[x] and leave[x] <= leave[u]."""
    children: list[list[int]] = [[] for _ in range(n)]
    roots = []
    for v in range(n):
        if preds[v]:
            children[max(preds[v])].append(v)
        else:
            roots.append(v)
    enter = [0] * n
    leave = [0] * n
    clock = 0
    for root in roots:
        stack = [(root, 0)]
        enter[root] = clock
        clock += 1
        while stack:
            v, k = stack[-1]
            if k < len(children[v]):
                stack[-1] = (v, k + 1)
                c = children[v][k]
                enter[c] = clock
                clock += 1
                stack.append((c, 0))
            else:
                stack.pop()
                leave[v] = clock
    return enter, leave
