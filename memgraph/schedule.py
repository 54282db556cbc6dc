"""The steps BuildMemGraph simulates, and the facts about them it needs up front.

A *step* is one of: a TaskGraph vertex (``TASK``), returning a step output
(``OUT``: read the value, right after its producer), or writing an updated
parameter/state back into its input's home (``WB``: as soon as the update is
produced and every reader of the old value has run; nothing to do when the update was made in
place in the home). Knowing every step's
position lets the builder ask "when is this value used next?" (eviction) and
"what is the most arena any single step needs at once?" (the smallest budget).
"""

from __future__ import annotations

import itertools

from ..ir.plan import CPU, GPU, Plan
from ..ir.sizes import aligned
from ..ir.taskgraph import TaskGraph, TensorRef, ValueKind

TASK, OUT, WB = 0, 1, 2


def _inputs(vertex) -> list[int]:
    """vertex.inputs(), with a fast path for the common flat argument tuple."""
    if not vertex.kwargs and not vertex.copy_in and all(type(a) is TensorRef for a in vertex.args):
        return list(dict.fromkeys(a.value for a in vertex.args))
    return vertex.inputs()


class Schedule:
    def __init__(self, tg: TaskGraph, order: list[int], plan: Plan, alignment: int):
        values = tg.values
        self.size = [aligned(v.nbytes, alignment) for v in values]
        self.inputs = [_inputs(vertex) for vertex in tg.vertices]
        self.outputs = [[o for o in vertex.outputs if o >= 0] for vertex in tg.vertices]
        for vid, home in plan.home.items():
            if home not in (GPU, CPU):
                raise ValueError(f"plan.home[{vid}] is {home!r}, expected 'gpu' or 'cpu'")
        # a persistent value nothing reads or updates (a frozen weight kept half-width instead,
        # trace/half_width.py) needs no place: its state is its initial state
        unplaced = tg.unused_persistent()
        self.gpu_home = [v.kind.is_persistent and v.id not in unplaced and plan.home_of(v.id) == GPU for v in values]
        self.cpu_home = [v.kind.is_persistent and v.id not in unplaced and plan.home_of(v.id) == CPU for v in values]

        # -- place OUT and WB steps between the task steps --------------------------------
        pos = {vid: k for k, vid in enumerate(order)}
        last_read = [-1] * len(values)  # index in `order` of the last task reading each value
        for k, vid in enumerate(order):
            for x in self.inputs[vid]:
                last_read[x] = k

        def produced_at(v: int) -> int:
            producer = values[v].producer
            return pos[producer] if values[v].kind is ValueKind.INTERMEDIATE and producer >= 0 else -1

        extra: dict[int, list[tuple]] = {}
        out_at: dict[int, int] = {}
        for name, v in tg.outputs.items():
            k = produced_at(v)
            extra.setdefault(k, []).append((OUT, name, v))
            out_at[v] = max(out_at.get(v, -1), k)
        for src, dst in tg.bindings.items():
            if src == dst:
                continue
            if values[dst].kind is not ValueKind.INTERMEDIATE:
                raise ValueError(f"binding {src} -> {dst}: the updated value must be produced by the step")
            k = max(produced_at(dst), last_read[src], out_at.get(src, -1))
            extra.setdefault(k, []).append((WB, src, dst))
        self.steps: list[tuple] = list(extra.get(-1, []))
        for k, vid in enumerate(order):
            self.steps.append((TASK, vid))
            self.steps.extend(extra.get(k, []))

        # -- uses: the steps reading each value, in order -------------------------------
        self.uses: list[list[int]] = [[] for _ in values]
        self.task_step = {}
        for s, step in enumerate(self.steps):
            if step[0] == TASK:
                self.task_step[step[1]] = s
                for x in self.inputs[step[1]]:
                    self.uses[x].append(s)
            elif step[0] == OUT:
                self.uses[step[2]].append(s)
            else:
                self.uses[step[2]].append(s)

        # -- in place: an op that updates a value whose old version nobody reads after it writes
        #    the new version into the old one's bytes (no copy, no second buffer). A persistent old
        #    version is overwritten only when the step updates it (it is bound to a new version). --
        self.in_place: dict[int, list[tuple[int, int]]] = {}  # task vertex -> [(old value, new value)]
        updated = {src for src, dst in tg.bindings.items() if src != dst}
        for vid in order:
            for old, new in tg.vertices[vid].copy_in:
                kind = values[old].kind
                overwritable = kind in (ValueKind.INTERMEDIATE, ValueKind.BATCH) or old in updated
                if overwritable and self.size[old] == self.size[new] and self.uses[old] \
                        and self.uses[old][-1] == self.task_step[vid]:
                    self.in_place.setdefault(vid, []).append((old, new))
        for vid, pairs in self.in_place.items():
            taken = {new for _, new in pairs}
            self.outputs[vid] = [o for o in self.outputs[vid] if o not in taken]
        self.host = set(plan.host_update)
        for vid in sorted(self.host):
            self._check_host_update(tg, vid)

        # -- plan.offload: offload after production, free across the longest gap between uses,
        #    reload before the use after the gap (forward activation -> backward use) ---------
        self.offload_after: set[int] = set()
        self.release_at: dict[int, list[int]] = {}
        for v in sorted(plan.offload):
            if not 0 <= v < len(values) or values[v].kind is not ValueKind.INTERMEDIATE or values[v].producer < 0:
                continue
            times = [self.task_step[values[v].producer]] + self.uses[v]
            gap, at = max((b - a, a) for a, b in itertools.pairwise(times)) if len(times) > 1 else (0, -1)
            if gap >= 2:  # something runs in between: worth freeing the bytes
                self.offload_after.add(v)
                self.release_at.setdefault(at, []).append(v)

        # -- plan.release_after: a CPU-homed value leaves the arena where a planned fetch run ends
        for v, vids in plan.release_after.items():
            if 0 <= v < len(values) and self.cpu_home[v]:
                for vid in vids:
                    if vid in self.task_step:
                        self.release_at.setdefault(self.task_step[vid], []).append(v)

        # -- the most arena any single step needs at once on its device, beside the GPU homes ----------
        self.device = [v.device for v in values]
        self.home_bytes_on = [0] * tg.devices  # bytes of the GPU homes on each device
        for v in range(len(values)):
            if self.gpu_home[v]:
                self.home_bytes_on[self.device[v]] += self.size[v]
        self.home_bytes = max(self.home_bytes_on)  # the most any device holds
        # per step: the most (homes + what the step reads and writes there) over the devices it touches,
        # less the homes of the fullest device, so home_bytes + need[s] is the step's floor
        self.need = [0] * len(self.steps)
        for s, step in enumerate(self.steps):
            on = [0] * tg.devices
            if step[0] == TASK and step[1] in self.host:
                pass  # reads and writes pinned CPU storage only
            elif step[0] == TASK:
                vid = step[1]
                for x in itertools.chain(self.outputs[vid], (x for x in self.inputs[vid] if not self.gpu_home[x])):
                    on[self.device[x]] += self.size[x]
            elif not self.gpu_home[step[2]]:
                on[self.device[step[2]]] += self.size[step[2]]
            self.need[s] = max(home + b for home, b in zip(self.home_bytes_on, on)) - self.home_bytes
        self.max_workspace = tg.step_workspace()

    def _check_host_update(self, tg: TaskGraph, vid: int) -> None:
        """A vertex the plan runs on the host must be an optimizer update that writes every result
        over its old version in a CPU home (nothing of it may need the arena)."""
        if not 0 <= vid < len(tg.vertices):
            raise ValueError(f"plan.host_update names vertex {vid}, which the TaskGraph does not have")
        vertex = tg.vertices[vid]
        pairs = self.in_place.get(vid, [])
        homed = all(self.cpu_home[old] for old, _ in pairs)
        if vertex.phase != "optimizer" or self.outputs[vid] or not pairs or not homed:
            raise ValueError(f"plan.host_update names vertex {vid} ({vertex.op}, {vertex.phase} phase): only an "
                             f"optimizer update whose parameters and states are all homed on the CPU, each "
                             f"updated in place, runs on the host")

    def plan_floor(self) -> tuple[int, int]:
        """(smallest GPU budget the builder can always run in when CPU storage is unbounded,
        the step needing it)."""
        if not self.steps:
            return self.home_bytes + self.max_workspace, -1
        s = max(range(len(self.steps)), key=self.need.__getitem__)
        return self.home_bytes + self.need[s] + self.max_workspace, s

    def task_vertex_of(self, tg: TaskGraph, s: int) -> int:
        """The TaskGraph vertex to blame for step s (its own, or the producer of what it reads)."""
        if s < 0:
            return -1
        step = self.steps[s]
        if step[0] == TASK:
            return step[1]
        return tg.values[step[2]].producer
