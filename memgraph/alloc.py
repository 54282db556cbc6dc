"""Simulated byte-range allocators for BuildMemGraph (the paper's simMalloc / simFree).

Nothing is allocated for real: a `RangeAllocator` tiles a byte region into
segments that are either occupied by one `Tenancy` or free. A free segment
("run") keeps the history of the bytes it covers as *pieces*
``(start, end, last_tenancy, freed_at)``: whoever writes those bytes next must
wait for every reader of ``last_tenancy`` (the memory dependencies of the
paper's Figure 9). Adjacent free runs merge, their pieces stay exact, so a new
tenancy only waits for the tenancies whose bytes it really overwrites.

Sizes and offsets are in bytes, already rounded to the alignment by the caller.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque

from ..ir.memgraph import Place

START = -1  # writer id of a tenancy that holds its bytes when the step starts (a home)
FIT_CANDIDATES = 16  # free runs examined per allocation from each end of the by-size index
VICTIM_CANDIDATES = 2  # most expendable tenancies around which eviction windows are scanned


class Tenancy:
    """One stay of one value in one byte range: written once, read many times, then freed.

    ``writer`` is the MemGraph vertex that writes the bytes (``START`` for a home at
    step start, ``None`` while the range is only reserved ahead of its producer);
    ``pending`` are the vertices that must finish before the writer may run
    (readers of the previous occupants); ``cost`` is what evicting it would cost
    (the step of its next use, larger is cheaper to evict).
    """

    __slots__ = (
        "alive",
        "cost",
        "end",
        "home",
        "pending",
        "place",
        "readers",
        "saved",
        "start",
        "step",
        "value",
        "writer",
    )

    def __init__(self, value: int, step: int = -1):
        self.value = value
        self.start = self.end = 0
        self.place: Place | None = None
        self.writer: int | None = None
        self.readers: list[int] = []
        self.pending: list[int] = []
        self.step = step  # for a reservation: the step whose vertex will write it
        self.saved: list | None = None  # the free pieces it replaced, restored if the reservation is revoked
        self.home = False  # a home is never freed
        self.cost = 0
        self.alive = False  # holds bytes of an allocator now

    def __repr__(self) -> str:  # debugging aid
        return f"Tenancy(v{self.value} [{self.start},{self.end}) w={self.writer})"


def wait_for(history: list[Tenancy]) -> list[int]:
    """Vertices a new writer of these bytes must wait for: readers of the last occupants
    (or their writer, when nobody read them)."""
    preds: list[int] = []
    for old in history:
        if old.readers:
            preds.extend(old.readers)
        elif old.writer is not None and old.writer >= 0:
            preds.append(old.writer)
    return preds


class _Seg:
    """A segment of the region: occupied by one tenancy, or a free run with its pieces' history."""

    __slots__ = ("end", "next", "pieces", "prev", "start", "tenancy")

    def __init__(self, start: int, end: int, tenancy: Tenancy | None, pieces: list | None):
        self.start, self.end, self.tenancy, self.pieces = start, end, tenancy, pieces
        self.prev: _Seg | None = None
        self.next: _Seg | None = None


class RangeAllocator:
    """Segments tiling ``[base, limit)`` (a linked list); free runs remember who used their bytes last.

    ``fresh_time`` is the "freed at" time of never-used bytes: -1 on the GPU (the
    paper's policy: fresh bytes add no dependency at all, use them first), a huge
    number for pinned CPU storage (reuse first, keep the storage small).
    ``two_sided``: a run may be used from its end as well as from its start.
    Only free runs are indexed by sorted lists (by start, by size): they stay few
    while occupied segments grow with the budget.
    """

    def __init__(self, base: int, limit: int, where: str, fresh_time: int, two_sided: bool, device: int = 0):
        self.base, self.limit, self.where, self.device = base, limit, where, device
        self.two_sided = two_sided
        self.high = base  # highest end ever used
        self.live = 0  # bytes occupied now
        self.peak_live = 0
        self._segs: dict[int, _Seg] = {}  # start -> segment
        self._head: _Seg | None = None
        self._free_starts: list[int] = []  # starts of free runs, sorted
        self._by_room: list[tuple[int, int]] = []  # (size, start) of free runs, sorted
        self._heap: list[tuple[int, int, Tenancy]] = []  # (-cost, seq, tenancy), lazily invalidated
        self._seq = itertools.count()
        if limit > base:
            self._head = self._new_free(base, limit, [(base, limit, None, fresh_time)])

    # -- segment bookkeeping --------------------------------------------------------------
    def _new_free(self, start: int, end: int, pieces: list) -> _Seg:
        seg = _Seg(start, end, None, pieces)
        self._segs[start] = seg
        bisect.insort(self._free_starts, start)
        bisect.insort(self._by_room, (end - start, start))
        return seg

    def _drop_free(self, seg: _Seg) -> None:
        seg.prev = seg.next = None  # no cycles among dead segments: refcounting frees them at once
        del self._segs[seg.start]
        del self._free_starts[bisect.bisect_left(self._free_starts, seg.start)]
        del self._by_room[bisect.bisect_left(self._by_room, (seg.end - seg.start, seg.start))]

    def _link(self, prev: _Seg | None, chain: list[_Seg], nxt: _Seg | None) -> None:
        for a, b in itertools.pairwise(chain):
            a.next, b.prev = b, a
        chain[0].prev, chain[-1].next = prev, nxt
        if prev is None:
            self._head = chain[0]
        else:
            prev.next = chain[0]
        if nxt is not None:
            nxt.prev = chain[-1]

    def set_cost(self, tenancy: Tenancy, cost: int) -> None:
        """How expendable the tenancy is (larger: evict sooner); it becomes an eviction candidate."""
        tenancy.cost = cost
        heap = self._heap
        heapq.heappush(heap, (-cost, next(self._seq), tenancy))
        if len(heap) > 4 * len(self._segs) + 1024:  # mostly stale entries: rebuild from the live ones
            self._heap = [(-t.cost, next(self._seq), t) for t in self.tenancies()]
            heapq.heapify(self._heap)

    # -- simMalloc --------------------------------------------------------------
    def find_fit(self, size: int) -> int | None:
        """Offset of a free window of ``size`` bytes whose bytes were freed earliest (ties: the
        tightest run, then the lowest address); None when nothing fits. Examines the tightest and
        the largest runs that fit (a bounded number), which include the never-used space."""
        by_room = self._by_room
        i = bisect.bisect_left(by_room, (size, -1))
        fitting = len(by_room) - i
        if fitting <= 0:
            return None
        if fitting <= 2 * FIT_CANDIDATES:
            runs = by_room[i:]
        else:
            runs = by_room[i:i + FIT_CANDIDATES] + by_room[-FIT_CANDIDATES:]
        best_key = None
        best = None
        segs = self._segs
        for room, rs in runs:
            seg = segs[rs]
            pieces = seg.pieces
            we = rs + size
            oldest = -(1 << 62)
            for s, _e, _t, f in pieces:  # front window: pieces overlapping [rs, rs+size)
                if s >= we:
                    break
                oldest = max(oldest, f)
            key = (oldest, room, rs)
            if best_key is None or key < best_key:
                best_key, best = key, rs
            if self.two_sided and room > size:
                ws = seg.end - size
                oldest = -(1 << 62)
                for _s, e, _t, f in reversed(pieces):
                    if e <= ws:
                        break
                    oldest = max(oldest, f)
                key = (oldest, room, ws)
                if key < best_key:
                    best_key, best = key, ws
        return best

    def alloc(self, ws: int, size: int, tenancy: Tenancy) -> list[Tenancy]:
        """Give ``[ws, ws+size)`` (inside one free run) to ``tenancy``; return the previous
        occupants of those bytes, whose readers the tenancy's writer must wait for."""
        k = bisect.bisect_right(self._free_starts, ws) - 1
        run = self._segs[self._free_starts[k]] if k >= 0 else None
        we = ws + size
        if run is None or run.end < we:
            raise AssertionError(f"[{ws},{we}) is not inside a free run")
        rs, re = run.start, run.end
        left, inside, right = [], [], []
        for piece in run.pieces:
            s, e, t, f = piece
            if s < ws:
                left.append(piece if e <= ws else (s, ws, t, f))
            if e > ws and s < we:
                inside.append(piece if s >= ws and e <= we else (max(s, ws), min(e, we), t, f))
            if e > we:
                right.append(piece if s >= we else (we, e, t, f))
        prev, nxt = run.prev, run.next
        self._drop_free(run)
        chain = []
        if ws > rs:
            chain.append(self._new_free(rs, ws, left))
        mid = _Seg(ws, we, tenancy, None)
        self._segs[ws] = mid
        chain.append(mid)
        if we < re:
            chain.append(self._new_free(we, re, right))
        self._link(prev, chain, nxt)
        tenancy.start, tenancy.end, tenancy.saved = ws, we, inside
        tenancy.place = Place(self.where, ws, size, self.device)
        tenancy.alive = True
        self.high = max(self.high, we)
        self.live += size
        self.peak_live = max(self.peak_live, self.live)
        seen: dict[int, Tenancy] = {}
        for _s, _e, t, _f in inside:
            if t is not None:
                seen.setdefault(id(t), t)
        return list(seen.values())

    # -- simFree ----------------------------------------------------------------
    def free(self, tenancy: Tenancy, now: int) -> None:
        """The tenancy's bytes become free; their next writer waits for its readers."""
        self._release(tenancy, [(tenancy.start, tenancy.end, tenancy, now)])

    def revoke(self, tenancy: Tenancy) -> None:
        """Undo a reservation that was never written: the bytes get their old history back."""
        self._release(tenancy, tenancy.saved)

    def replace(self, old: Tenancy, new: Tenancy) -> None:
        """``new`` takes over ``old``'s bytes in place (a home slot written back)."""
        seg = self._segs[old.start]
        assert seg.tenancy is old
        seg.tenancy = new
        new.start, new.end, new.place = old.start, old.end, old.place
        old.alive, new.alive = False, True

    def _release(self, tenancy: Tenancy, pieces: list) -> None:
        seg = self._segs.pop(tenancy.start)
        assert seg.tenancy is tenancy, "freeing a tenancy that does not own its bytes"
        tenancy.alive = False
        self.live -= seg.end - seg.start
        prev, nxt = seg.prev, seg.next
        seg.prev = seg.next = seg.tenancy = None
        start, end = seg.start, seg.end
        if prev is not None and prev.tenancy is None:  # merge with the free run on the left
            start = prev.start
            pieces = _join(prev.pieces, pieces)
            dead, prev = prev, prev.prev
            self._drop_free(dead)
        if nxt is not None and nxt.tenancy is None:  # and with the one on the right
            end = nxt.end
            pieces = _join(pieces, nxt.pieces)
            dead, nxt = nxt, nxt.next
            self._drop_free(dead)
        self._link(prev, [self._new_free(start, end, pieces)], nxt)

    # -- simMallocOffld: where to evict -----------------------------------------
    def fits_at(self, ws: int, size: int) -> bool:
        """``[ws, ws+size)`` lies inside one free run."""
        k = bisect.bisect_right(self._free_starts, ws) - 1
        return k >= 0 and self._segs[self._free_starts[k]].end >= ws + size

    def occupants(self, ws: int, we: int) -> list[Tenancy]:
        """Tenancies overlapping [ws, we)."""
        seg = self._seg_at(ws)
        found = []
        while seg is not None and seg.start < we:
            if seg.tenancy is not None:
                found.append(seg.tenancy)
            seg = seg.next
        return found

    def _seg_at(self, offset: int) -> _Seg:
        """The segment containing offset: from the nearest free run at or before it, walk right."""
        k = bisect.bisect_right(self._free_starts, offset) - 1
        seg = self._segs[self._free_starts[k]] if k >= 0 else self._head
        while seg.end <= offset:
            seg = seg.next
        return seg

    def close(self) -> None:
        """Unlink the segments (they form prev/next cycles) so refcounting frees them."""
        for seg in self._segs.values():
            seg.prev = seg.next = None
        self._head = None

    def tenancies(self) -> list[Tenancy]:
        return [seg.tenancy for seg in self._segs.values() if seg.tenancy is not None]

    def best_window(self, size: int, pinned: set, free_cost: int) -> int | None:
        """Offset of the window of ``size`` bytes whose most needed occupant is needed the latest
        (max over windows of min occupant ``cost``, free bytes cost ``free_cost``); windows holding
        a pinned tenancy are excluded. Windows are scanned around the few most expendable
        tenancies (lazy max-heap on cost), then over the whole region if none of those works."""
        heap = self._heap
        picked: list[tuple[int, int, Tenancy]] = []
        victims = 0
        while heap and victims < VICTIM_CANDIDATES:
            entry = heapq.heappop(heap)
            t = entry[2]
            if not t.alive or -entry[0] != t.cost:
                continue  # stale: freed, or its cost changed since
            picked.append(entry)
            if t not in pinned:
                victims += 1
        for entry in picked:
            heapq.heappush(heap, entry)
        best, best_score = None, -1
        for _c, _s, t in picked:
            if t in pinned:
                continue
            segs = [self._segs[t.start]]
            while segs[0].prev is not None and segs[0].start > t.end - size:
                segs.insert(0, segs[0].prev)
            while segs[-1].next is not None and segs[-1].end < t.start + size:
                segs.append(segs[-1].next)
            at, score = self._scan(segs, size, pinned, free_cost)
            if score > best_score:
                best, best_score = at, score
        if best is None:
            segs = []
            seg = self._head
            while seg is not None:
                segs.append(seg)
                seg = seg.next
            best, best_score = self._scan(segs, size, pinned, free_cost)
        return best

    def _scan(self, segs: list[_Seg], size: int, pinned: set, free_cost: int) -> tuple[int | None, int]:
        """Best window within consecutive segments, aligned to a segment start or a segment end."""
        n = len(segs)
        if n == 0:
            return None, -1
        starts = [seg.start for seg in segs]
        ends = [seg.end for seg in segs]
        costs = [free_cost if seg.tenancy is None else (-1 if seg.tenancy in pinned else seg.tenancy.cost)
                 for seg in segs]
        first, last = starts[0], ends[-1]
        best, best_score = None, -1
        dq: deque[int] = deque()
        j = 0
        for i in range(n):  # windows starting at a segment start
            we = starts[i] + size
            if we > last:
                break
            while j < n and starts[j] < we:
                c = costs[j]
                while dq and costs[dq[-1]] >= c:
                    dq.pop()
                dq.append(j)
                j += 1
            while dq[0] < i:
                dq.popleft()
            if costs[dq[0]] > best_score:
                best, best_score = starts[i], costs[dq[0]]
        if self.two_sided:  # windows ending at a segment end
            dq.clear()
            j = n - 1
            for i in range(n - 1, -1, -1):
                ws = ends[i] - size
                if ws < first:
                    break
                while j >= 0 and ends[j] > ws:
                    c = costs[j]
                    while dq and costs[dq[-1]] >= c:
                        dq.pop()
                    dq.append(j)
                    j -= 1
                while dq[0] > i:
                    dq.popleft()
                if costs[dq[0]] > best_score:
                    best, best_score = ws, costs[dq[0]]
        return best, best_score


def _join(left: list, right: list) -> list:
    """Concatenate two runs' pieces, fusing the seam when it splits one old tenancy."""
    if left and right:
        ls, le, lt, lf = left[-1]
        rs, re, rt, rf = right[0]
        if lt is rt and lf == rf and le == rs:
            return left[:-1] + [(ls, re, lt, lf)] + right[1:]
    return left + right
