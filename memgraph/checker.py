"""Check a MemGraph for correctness, independently of how it was built.

``verify(mg)`` returns readable violations (empty list: valid). It looks only
at the MemGraph's vertices, edges, places and TaskGraph, never at the
builder's bookkeeping:

(a) every TaskGraph data dependency is kept: each read of a value is traced,
    through DATA edges, back over reloads/offloads/copies to the value's
    producer (or its INPUT vertex, or its home at step start);
(b) race-free: the writes of every byte range (arena or CPU storage) are
    replayed in serial order; whenever a placement overwrites bytes of an
    earlier one, the earlier writer and every reader of the earlier one must
    precede the later writer in the partial order. A virtual START writes the
    homes; a virtual END reads them, so the step's final state is protected;
(c) acyclic, every edge forward in ``mg.serial``;
(d) every place lies in the arena (or CPU storage), which fits the budgets.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

from ..ir.describe import format_vertex
from ..ir.memgraph import Edge, Kind, MemGraph, Stream
from ..ir.sizes import arena_capacity
from ..ir.taskgraph import ValueKind
from .segments import segment_problems

START, END = "start", "end"  # virtual writer of the homes / reader of the final homes
MAX_REPORTS = 40  # per kind of violation
STREAM_OF = {Kind.COMPUTE: Stream.COMPUTE, Kind.COPY: Stream.COMPUTE, Kind.OFFLOAD: Stream.D2H,
             Kind.OUTPUT: Stream.D2H, Kind.RELOAD: Stream.H2D, Kind.INPUT: Stream.H2D}
# where else a compute vertex runs: the host's cores, a transfer lane, the messages' lane
ALSO_COMPUTE = (Stream.HOST, Stream.D2D, Stream.COMM)


def verify(mg: MemGraph) -> list[str]:
    return _Verifier(mg).run()


class _Verifier:
    def __init__(self, mg: MemGraph):
        self.mg = mg
        self.tg = mg.taskgraph
        self.n = len(mg.vertices)
        self.problems: list[str] = []
        self.counts: dict[str, int] = defaultdict(int)

    def report(self, kind: str, message: str) -> None:
        self.counts[kind] += 1
        if self.counts[kind] <= MAX_REPORTS:
            self.problems.append(f"({kind}) {message}")

    def name(self, x) -> str:
        if x == START:
            return "START"
        if x == END:
            return "END"
        return format_vertex(self.mg, x, inputs=False)

    def run(self) -> list[str]:
        if not self._structure() or not self._order():
            return self._finish()
        for problem in segment_problems(self.mg):
            self.report("segments", problem)
        self._collect_placements()
        self._check_data()
        self._check_races()
        self._check_bounds()
        self._evaluate()
        return self._finish()

    def _finish(self) -> list[str]:
        for kind, count in sorted(self.counts.items()):
            if count > MAX_REPORTS:
                self.problems.append(f"({kind}) ... {count - MAX_REPORTS} more violations of this kind")
        return self.problems

    # -- structure, (c) ---------------------------------------------------------------
    def _structure(self) -> bool:
        mg, n = self.mg, self.n
        ok = True
        for i, v in enumerate(mg.vertices):
            if v.id != i:
                self.report("structure", f"vertex at position {i} has id {v.id}")
                ok = False
            if STREAM_OF.get(v.kind) is not v.stream and not (v.kind is Kind.COMPUTE and v.stream in ALSO_COMPUTE):
                self.report("structure", f"{v.kind.value} #{i} is on stream {v.stream}")
            if v.kind is Kind.COMPUTE:  # the GPU's streams see the arena, the host's cores pinned storage
                where = "cpu" if v.stream is Stream.HOST else "gpu"
                stray = sorted(x for places in (v.reads, v.writes) for x, p in places.items() if p.where != where)
                if stray:
                    self.report("structure", f"compute #{i} on stream {v.stream.value} places values {stray[:5]} "
                                             f"outside the {where} storage")
                # a kernel touches its own device's arena only; a transfer reads another's
                places = [p for p in v.writes.values() if p.where == "gpu"] + \
                         ([] if v.stream is Stream.D2D else [p for p in v.reads.values() if p.where == "gpu"])
                if len({p.device for p in places}) > 1:
                    self.report("structure", f"compute #{i} ({v.stream.value}) touches the arenas of devices "
                                             f"{sorted({p.device for p in places})}")
        self.edge_kind: dict[tuple[int, int], Edge] = {}
        self.preds: list[list[int]] = [[] for _ in range(n)]
        for src, dst, kind in mg.edges:
            if not (0 <= src < n and 0 <= dst < n) or src == dst:
                self.report("structure", f"edge {src} -> {dst} is out of range or a self-loop")
                ok = False
                continue
            if (src, dst) in self.edge_kind:
                self.report("structure", f"duplicate edge {src} -> {dst}")
                if kind is Edge.DATA:
                    self.edge_kind[(src, dst)] = kind
                continue
            self.edge_kind[(src, dst)] = kind
            self.preds[dst].append(src)
        return ok

    def _order(self) -> bool:
        n, mg = self.n, self.mg
        indeg = [len(p) for p in self.preds]
        succs: list[list[int]] = [[] for _ in range(n)]
        for dst in range(n):
            for src in self.preds[dst]:
                succs[src].append(dst)
        ready = [v for v in range(n) if indeg[v] == 0]
        topo = []
        while ready:
            v = ready.pop()
            topo.append(v)
            for w in succs[v]:
                indeg[w] -= 1
                if indeg[w] == 0:
                    ready.append(w)
        if len(topo) < n:
            stuck = [v for v in range(n) if indeg[v] > 0]
            self.report("c", f"the MemGraph has a cycle among {len(stuck)} vertices, e.g. {stuck[:8]}")
            return False
        if sorted(mg.serial) == list(range(n)):
            pos = [0] * n
            for k, v in enumerate(mg.serial):
                pos[v] = k
            backward = [(s, d) for (s, d) in self.edge_kind if pos[s] >= pos[d]]
            for s, d in backward:
                self.report("c", f"edge {self.name(s)} -> {self.name(d)} goes backward in mg.serial")
            if not backward:
                topo = list(mg.serial)
        else:
            self.report("c", "mg.serial is not a permutation of the MemGraph's vertices")
        self.topo = topo
        self.pos = [0] * n
        for k, v in enumerate(topo):
            self.pos[v] = k
        self.queries: list[tuple[int, int, str, str]] = []  # (x, y, kind, message): x must precede y
        return True

    def precede(self, x, y, kind: str, message: str) -> None:
        """Require x to precede y in every order the edges allow (checked in bulk later)."""
        if x == END or y == START or x == y:
            self.report(kind, message)
        elif x != START and y != END:
            self.queries.append((x, y, kind, message))

    def _evaluate(self) -> None:
        """Answer all precedence queries with ancestor bitsets, a chunk of sources at a time."""
        by_src: dict[int, list[int]] = defaultdict(list)
        for qi, (x, _y, _k, _m) in enumerate(self.queries):
            by_src[x].append(qi)
        sources = sorted(by_src, key=self.pos.__getitem__)
        chunk = 4096
        for c in range(0, len(sources), chunk):
            group = sources[c:c + chunk]
            bit = {x: 1 << k for k, x in enumerate(group)}
            last = max(self.pos[self.queries[qi][1]] for x in group for qi in by_src[x])
            reach: dict[int, int] = {}  # vertex -> bits of group members that are its ancestors
            for v in self.topo[self.pos[group[0]]:last + 1]:
                acc = 0
                for p in self.preds[v]:
                    r = reach.get(p)
                    if r:
                        acc |= r
                    b = bit.get(p)
                    if b:
                        acc |= b
                if acc:
                    reach[v] = acc
            for x in group:
                for qi in by_src[x]:
                    _x, y, kind, message = self.queries[qi]
                    if not (reach.get(y, 0) & bit[x]):
                        self.report(kind, message)

    # -- placements and who reads them ---------------------------------------------------
    def _collect_placements(self) -> None:
        """A placement is one write of a value to a place; each read is attributed to the latest
        placement of the same value at the same place before it in the (checked) order."""
        self.placements: list[tuple] = []  # (writer, value, place)
        self.readers: list[list] = []
        by_key: dict[tuple, list[int]] = defaultdict(list)
        for v, place in self.mg.homes.items():
            by_key[(v, place)].append(len(self.placements))
            self.placements.append((START, v, place))
            self.readers.append([])
        for w in self.topo:
            for v, place in self.mg.vertices[w].writes.items():
                by_key[(v, place)].append(len(self.placements))
                self.placements.append((w, v, place))
                self.readers.append([])
        self.wpos = [-1 if w == START else self.pos[w] for w, _v, _p in self.placements]
        self.source: dict[tuple, int] = {}  # (reader, value) -> placement it reads

        def attribute(r, v, place) -> int | None:
            cands = by_key.get((v, place), [])
            rpos = self.n if r == END else self.pos[r]
            k = bisect.bisect_left([self.wpos[c] for c in cands], rpos) - 1
            if k < 0:
                self.report("a", f"{self.name(r)} reads value {v} at {place} where nothing wrote it before")
                return None
            pl = cands[k]
            self.readers[pl].append(r)
            self.source[(r, v)] = pl
            self.precede(self.placements[pl][0], r, "a",
                         f"{self.name(r)} may read value {v} at {place} before {self.name(self.placements[pl][0])} "
                         f"writes it")
            return pl

        for r in self.topo:
            for v, place in self.mg.vertices[r].reads.items():
                attribute(r, v, place)
        # the step's end state: every home holds its bound (updated) value
        for v, place in self.mg.homes.items():
            final = self.tg.bindings.get(v, v)
            if attribute(END, final, place) is not None:
                self._trace(END, final, f"value {final} at the end of the step (home of {v})")

    def _trace(self, reader, value: int, what: str) -> None:
        """(a): follow DATA edges from a read back to the value's origin."""
        values = self.tg.values
        for _ in range(self.n + 2):
            pl = self.source.get((reader, value))
            if pl is None:
                return  # already reported
            writer = self.placements[pl][0]
            if writer == START:
                if not values[value].kind.is_persistent or self.mg.homes.get(value) != self.placements[pl][2]:
                    self.report("a", f"{what}: read from a home that does not hold it at step start")
                return
            if reader != END and self.edge_kind.get((writer, reader)) is not Edge.DATA:
                self.report("a", f"{what}: no data edge {self.name(writer)} -> {self.name(reader)}")
                return
            mv = self.mg.vertices[writer]
            if mv.kind is Kind.COMPUTE:
                if values[value].producer != mv.task_vertex:
                    self.report("a", f"{what}: bytes come from {self.name(writer)}, not from its producer")
                return
            if mv.kind is Kind.INPUT:
                if values[value].kind is not ValueKind.BATCH:
                    self.report("a", f"{what}: copied in by an INPUT vertex but it is not a batch value")
                return
            if value not in mv.reads:
                self.report("a", f"{what}: {self.name(writer)} writes it without reading it")
                return
            reader = writer  # RELOAD / OFFLOAD / COPY: keep following
        self.report("a", f"{what}: provenance chain does not end")

    def _check_data(self) -> None:
        tg, mg = self.tg, self.mg
        computes: dict[int, list[int]] = defaultdict(list)
        outputs: dict[str, list[int]] = defaultdict(list)
        for mv in mg.vertices:
            if mv.kind is Kind.COMPUTE:
                computes[mv.task_vertex].append(mv.id)
            elif mv.kind is Kind.OUTPUT:
                outputs[mv.name].append(mv.id)
        for vertex in tg.vertices:
            found = computes.get(vertex.id, [])
            if len(found) != 1:
                self.report("a", f"task vertex {vertex.id} ({vertex.op}) has {len(found)} compute vertices")
                continue
            mv = mg.vertices[found[0]]
            ins, outs = set(vertex.inputs()), {o for o in vertex.outputs if o >= 0}
            if set(mv.reads) != ins or set(mv.writes) != outs:
                self.report("a", f"{self.name(mv.id)} reads {sorted(mv.reads)} / writes {sorted(mv.writes)}, "
                                 f"its task vertex reads {sorted(ins)} / writes {sorted(outs)}")
            for x in mv.reads:
                self._trace(mv.id, x, f"input {x} of {self.name(mv.id)}")
        for name, v in tg.outputs.items():
            found = [m for m in outputs.get(name, []) if mg.vertices[m].value == v]
            if not found:
                self.report("a", f"step output {name!r} (value {v}) has no OUTPUT vertex")
            for m in found:
                self._trace(m, v, f"step output {name!r}")
        unused = tg.unused_persistent()  # nothing reads them: their state is their initial state
        for v in tg.values:
            if v.kind.is_persistent and v.id not in mg.homes and v.id not in unused:
                self.report("a", f"persistent value {v.id} ({v.name}) has no home")

    # -- (b) -------------------------------------------------------------------------------
    def _check_races(self) -> None:
        storages = sorted({(p.where, p.device if p.where == "gpu" else 0) for _w, _v, p in self.placements})
        for where, device in storages:  # each device's arena apart; the pinned storage is one
            ids = sorted((i for i, p in enumerate(self.placements)
                          if p[2].where == where and (where != "gpu" or p[2].device == device)),
                         key=self.wpos.__getitem__)
            starts: list[int] = []  # disjoint painted ranges: start -> (end, placement)
            paint: dict[int, tuple[int, int]] = {}
            pairs: set[tuple[int, int]] = set()
            for b in ids:
                place = self.placements[b][2]
                s, e = place.offset, place.end
                k = bisect.bisect_right(starts, s) - 1
                if k >= 0 and paint[starts[k]][0] <= s:
                    k += 1
                k = max(k, 0)
                pieces = []
                while k < len(starts) and starts[k] < e:
                    ps = starts.pop(k)
                    pe, a = paint.pop(ps)
                    pairs.add((a, b))
                    if ps < s:
                        pieces.append((ps, s, a))
                    if pe > e:
                        pieces.append((e, pe, a))
                pieces.append((s, e, b))
                for ps, pe, a in pieces:
                    bisect.insort(starts, ps)
                    paint[ps] = (pe, a)
            for a, b in sorted(pairs):
                wa, va, pa = self.placements[a]
                wb, vb, pb = self.placements[b]
                lo, hi = max(pa.offset, pb.offset), min(pa.end, pb.end)
                where_s = f"{where} bytes [{lo},{hi})" + (f" of device {device}" if where == "gpu" and device else "")
                self.precede(wa, wb, "b", f"race in {where_s}: {self.name(wb)} writes value {vb} there but may run "
                                          f"before {self.name(wa)} writes value {va}")
                for r in self.readers[a]:
                    if r == wb and pa == pb and self._updates_in_place(wb, va, vb):
                        continue  # an in-place op reads the old version where it writes the new one
                    self.precede(r, wb, "b", f"race in {where_s}: {self.name(wb)} writes value {vb} there while "
                                             f"{self.name(r)} may still read value {va}")

    def _updates_in_place(self, w, old: int, new: int) -> bool:
        """w is the compute vertex of an op that updates old into new (TaskGraph copy_in)."""
        if w in (START, END) or self.mg.vertices[w].kind is not Kind.COMPUTE:
            return False
        tv = self.mg.vertices[w].task_vertex
        return 0 <= tv < len(self.tg.vertices) and (old, new) in self.tg.vertices[tv].copy_in

    # -- (d) -------------------------------------------------------------------------------
    def _check_bounds(self) -> None:
        mg, tg = self.mg, self.tg
        workspace = tg.step_workspace()
        if mg.arena_bytes > arena_capacity(mg.plan.gpu_budget, workspace, mg.alignment):
            self.report("d", f"arena of {mg.arena_bytes} bytes + workspace {workspace} exceeds the GPU budget "
                             f"{mg.plan.gpu_budget}")
        if mg.plan.cpu_budget is not None and mg.cpu_bytes > mg.plan.cpu_budget:
            self.report("d", f"CPU storage of {mg.cpu_bytes} bytes exceeds the CPU budget {mg.plan.cpu_budget}")
        limit = {"gpu": mg.arena_bytes, "cpu": mg.cpu_bytes}
        for _w, v, place in self.placements:
            if place.where not in limit:
                self.report("d", f"value {v} placed in unknown storage {place.where!r}")
            elif place.offset < 0 or place.end > limit[place.where]:
                self.report("d", f"value {v} at {place} lies outside the {place.where} storage of "
                                 f"{limit[place.where]} bytes")
            if place.nbytes < tg.values[v].nbytes:
                self.report("d", f"value {v} needs {tg.values[v].nbytes} bytes but {place} holds {place.nbytes}")
            if mg.alignment and place.offset % mg.alignment:
                self.report("d", f"value {v} at {place} is not aligned to {mg.alignment}")
