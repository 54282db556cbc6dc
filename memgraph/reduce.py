"""Drop memory edges that other edges already imply (a cheap, partial transitive reduction).

A memory edge u -> w is redundant when u is an ancestor of another
predecessor of w: the partial order, hence every order the engine may pick,
is unchanged without it. Full transitive reduction is quadratic; here each
vertex gets a small backward search from its other predecessors, pruned to
vertices after the oldest memory predecessor (edges go forward in the
serial order, so nothing older can lead back to it). Found redundancies are
exact; redundancies the budget misses are simply kept. Data edges are never
dropped: they name where each input comes from.
"""

from __future__ import annotations

from collections import deque


def reduce_memory_edges(n: int, data: set[tuple[int, int]], memory: set[tuple[int, int]],
                        budget: int = 48) -> tuple[set[tuple[int, int]], int]:
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
    kept: set[tuple[int, int]] = set()
    for w in range(n):
        mine = mem_in[w]
        if not mine:
            continue
        if len(preds[w]) > 1:
            lo = min(mine)
            seen: set[int] = set()
            queue: deque[int] = deque()
            for p in preds[w]:
                for q in preds[p]:
                    if q >= lo and q not in seen:
                        seen.add(q)
                        queue.append(q)
            steps = 0
            targets = set(mine)
            while queue and steps < budget and not targets <= seen:
                x = queue.popleft()
                steps += 1
                for q in preds[x]:
                    if q >= lo and q not in seen:
                        seen.add(q)
                        queue.append(q)
            redundant = targets & seen
            if redundant:
                dropped += len(redundant)
                preds[w] = [p for p in preds[w] if p not in redundant]
                mine = [u for u in mine if u not in redundant]
        kept.update((u, w) for u in mine)
    return kept, dropped
