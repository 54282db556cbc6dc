"""The plan cache: a step planned once is not planned again.

    cache = PlanCache.open(True)     # default_plan_dir(): ~/.cache/turnip/plans, $TURNIP_CACHE_DIR/plans; False: None
    key = plan_key(tg, gpu_budget, cpu_budget, device="cuda", planner="auto", options={}, alignment=256,
                   costs=costs)
    hit = cache.load(key, tg, gpu_budget, cpu_budget)   # a CachedPlan, or None
    cache.store(key, CachedPlan(plan, walk="compact"), about={...})

The key is a SHA-256 over everything the plan depends on: the TaskGraph as the planner reads it
(every vertex's op, argument template, outputs, module, phase, time and workspace; every value's
shape, stride, dtype, bytes, kind and producer; outputs, bindings, batch inputs; never object ids
or weights), the GPU and CPU budgets in bytes, the device's type and name, the link bandwidths and
host cost per launch, the planner with its options and the alignment, the entry format
(PLAN_CACHE_VERSION) and the source of the planner itself (planners/*.py and ir/plan.py), so a
planner that changes plans anew.

An entry is one JSON file, ``<key>.json``: the Plan as the MemGraph file's tagged JSON (ir/serialize.py's
Codec, which builds nothing but a Plan and its Recompute records), which walk of the builder won
and its simulated step time (memgraph.compile keeps the fastest of several builds on CUDA). Reading
one runs no code. A file that is not JSON, not of this format or version, of another key, or whose
plan does not fit the TaskGraph and budgets is ignored with a warning (and overwritten by the next
store); so is one larger than MAX_FILE_BYTES. Writes go to a temporary file renamed into place, so
concurrent compiles never read half a file; past MAX_ENTRIES files the least recently used are
deleted.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..ir.plan import CPU, GPU, Plan, Recompute
from ..ir.serialize import Codec
from ..ir.taskgraph import ScalarRef, TaskGraph, TensorRef
from .costs import CostModel, default_cache_dir
from .measure import device_name

log = logging.getLogger(__name__)

FORMAT = "turnip.plan-cache"
PLAN_CACHE_VERSION = 1  # bump when an entry's layout or a Plan's meaning changes
MAX_FILE_BYTES = 64 << 20
MAX_ENTRIES = 256
# which build of the plan won: the allocate-ahead walk, the one reusing the bytes of transfers between
# devices last, or the compact one (memgraph/builder.py build_walks)
WALKS = (None, "ahead", "apart", "compact")
PLAN_TYPES = (Plan, Recompute)

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@dataclass
class CachedPlan:
    plan: Plan
    walk: str | None = None  # None: memgraph.build's own choice (the plan was built once)
    simulated_step_s: float | None = None  # the winner's simulated step, when compile simulated builds


def default_plan_dir() -> Path:
    """$TURNIP_PLAN_CACHE_DIR (the test suite gives each test its own), else $TURNIP_CACHE_DIR/plans,
    else $XDG_CACHE_HOME/turnip/plans, else ~/.cache/turnip/plans."""
    own = os.environ.get("TURNIP_PLAN_CACHE_DIR")
    return Path(own) if own else default_cache_dir() / "plans"


# -- the key ---------------------------------------------------------------------------------------

def _opaque(obj: Any) -> list:
    """A constant JSON has no word for (a torch dtype, a device, ...): its type and repr, without
    memory addresses. A constant's value never changes a plan, so an ambiguous repr costs nothing."""
    return ["O", type(obj).__qualname__, _ADDRESS.sub("", repr(obj))]


def _canonical(template: Any) -> Any:
    if isinstance(template, TensorRef):
        return ["T", template.value, list(template.size), list(template.stride), template.storage_offset]
    if isinstance(template, ScalarRef):
        return ["S", template.name]
    if isinstance(template, bool) or template is None or isinstance(template, (int, str)):
        return template
    if isinstance(template, float):
        return ["F", template.hex()]
    if isinstance(template, list):
        return ["L", [_canonical(t) for t in template]]
    if isinstance(template, tuple):
        return ["U", [_canonical(t) for t in template]]
    if isinstance(template, dict):
        return ["D", sorted(([repr(k), _canonical(v)] for k, v in template.items()), key=lambda kv: kv[0])]
    if isinstance(template, torch.device):  # its kind: which GPU of its kind a step runs on changes no plan (the
        return ["G", template.type]           # key has the device), and ranks tracing on their own GPUs compare alike
    return _opaque(template)


def taskgraph_digest(tg: TaskGraph) -> str:
    """SHA-256 of the TaskGraph as planners read it: structure, shapes, dtypes, ops, op times and
    workspace (so the costs it was annotated with), never weights or object ids. Two traces of
    one step give one digest."""
    h = hashlib.sha256()

    def put(obj: Any) -> None:
        h.update(json.dumps(obj, separators=(",", ":"), default=_opaque).encode())
        h.update(b"\n")

    put(["taskgraph", tg.device, tg.accumulation_steps, tg.runtime_reserve, sorted(tg.outputs.items()),
         sorted(tg.bindings.items()), list(tg.batch_inputs), len(tg.values), len(tg.vertices)])
    for v in tg.values:
        kind = getattr(v.kind, "value", v.kind)
        put([v.id, list(v.shape), list(v.stride), str(v.dtype), v.nbytes, kind, v.producer, v.name])
    for x in tg.vertices:
        put([x.id, x.op, _canonical(x.args), _canonical(x.kwargs), list(x.outputs), x.module, x.phase, x.random,
             float(x.time).hex(), x.workspace, x.recompute_of, [list(pair) for pair in x.copy_in]])
    return h.hexdigest()


@functools.cache
def planner_source_digest() -> str:
    """SHA-256 of the planner's source (planners/*.py and ir/plan.py): a changed planner misses."""
    files = sorted(Path(__file__).resolve().parent.glob("*.py")) + [Path(inspect.getfile(Plan)).resolve()]
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def cost_facts(costs: CostModel, device_type: str) -> dict:
    """What of the cost model the planner reads besides vertex times: bandwidths and host cost."""
    return {"h2d": float(costs.h2d_bandwidth), "d2h": float(costs.d2h_bandwidth),
            "duplex": float(costs.duplex_bandwidth),
            "host_per_vertex": float(costs.host_per_vertex_on(device_type)),
            "spec": getattr(getattr(costs, "spec", None), "name", None), "measured": bool(getattr(costs, "measure", False))}


def plan_key(tg: TaskGraph, gpu_budget: int, cpu_budget: int | None, *, device: str, planner: str, options: dict,
             alignment: int, costs: CostModel) -> str:
    """The cache key of planning tg within gpu_budget (and cpu_budget) bytes for `device` with
    `planner` and its options (time_limit included: a longer search may find a better plan)."""
    facts = {
        "format": FORMAT, "version": PLAN_CACHE_VERSION, "planner_source": planner_source_digest(),
        "taskgraph": taskgraph_digest(tg), "gpu_budget": int(gpu_budget),
        "cpu_budget": None if cpu_budget is None else int(cpu_budget),
        "device": {"type": str(device).split(":")[0], "name": device_name(str(device))},
        "planner": planner, "options": options, "alignment": int(alignment),
        "costs": cost_facts(costs, tg.device),
    }
    text = json.dumps(facts, sort_keys=True, separators=(",", ":"), default=_opaque)
    return hashlib.sha256(text.encode()).hexdigest()


# -- the files ---------------------------------------------------------------------------------------

def check_plan(plan: Any, tg: TaskGraph, gpu_budget: int, cpu_budget: int | None) -> None:
    """Raise TypeError or ValueError unless plan is a Plan for these budgets whose every id names a
    vertex or value of tg (what a damaged or foreign entry would get wrong)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"holds a {type(plan).__name__}, not a Plan")
    if plan.gpu_budget != gpu_budget or plan.cpu_budget != cpu_budget:
        raise ValueError(f"plans budgets ({plan.gpu_budget}, {plan.cpu_budget}), not ({gpu_budget}, {cpu_budget})")
    n, m = len(tg.vertices), len(tg.values)

    def ids(xs: Any, bound: int, what: str) -> None:
        if not all(type(x) is int and 0 <= x < bound for x in xs):
            raise ValueError(f"names {what} that the TaskGraph does not have")

    if plan.order is not None and (not isinstance(plan.order, list) or sorted(plan.order) != list(range(n))):
        raise ValueError("has an order that is not a permutation of the TaskGraph's vertices")
    if not isinstance(plan.recompute, list) or not all(isinstance(r, Recompute) for r in plan.recompute):
        raise TypeError("has a malformed recompute list")
    ids([r.vertex for r in plan.recompute] + [r.before for r in plan.recompute], n, "recomputed vertices")
    if any(tg.vertices[r.vertex].phase != "forward" for r in plan.recompute):
        raise ValueError("recomputes a vertex outside the forward pass")
    if not isinstance(plan.offload, set) or not isinstance(plan.home, dict) or not isinstance(plan.release_after, dict):
        raise TypeError("has malformed offload, home or release_after fields")
    ids(plan.offload, m, "offloaded values")
    ids(plan.home, m, "homed values")
    if not set(plan.home.values()) <= {GPU, CPU}:
        raise ValueError("homes a value somewhere other than the GPU or the CPU")
    ids(plan.release_after, m, "released values")
    for after in plan.release_after.values():
        if not isinstance(after, list):
            raise TypeError("has a malformed release_after list")
        ids(after, n, "release points")
    if not isinstance(plan.host_update, set):
        raise TypeError("has a malformed host_update field")
    ids(plan.host_update, n, "host-run updates")
    if not isinstance(plan.resident, set):
        raise TypeError("has a malformed resident field")
    ids(plan.resident, m, "resident values")


def _finite_or_none(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


class PlanCache:
    """Plans on disk, one JSON file per key, in `directory` (created on the first store)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    @classmethod
    def open(cls, cache: bool | str | os.PathLike | None) -> PlanCache | None:
        """True: the default folder (default_plan_dir); a path: that folder; False or None: no cache."""
        if cache is None or cache is False:
            return None
        if cache is True:
            return cls(default_plan_dir())
        if isinstance(cache, (str, os.PathLike)):
            return cls(cache)
        raise TypeError(f"cache must be True, False or a folder path, not {type(cache).__name__} {cache!r}")

    def path(self, key: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{64}", key):
            raise ValueError(f"not a plan cache key: {key!r}")
        return self.directory / f"{key}.json"

    def load(self, key: str, tg: TaskGraph, gpu_budget: int, cpu_budget: int | None) -> CachedPlan | None:
        """The entry of `key` checked against tg and the budgets, or None (absent, or ignored with
        a warning: damaged, foreign, of another version)."""
        path = self.path(key)
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
            doc = json.loads(path.read_bytes())
        except FileNotFoundError:
            log.info("plan cache: no plan for this step yet (%s)", path)
            return None
        except (OSError, ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            log.warning("ignoring plan cache file %s: not readable as JSON (%s); planning again", path, exc)
            return None
        try:
            entry = self._decode(doc, key)
            check_plan(entry.plan, tg, gpu_budget, cpu_budget)
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with the file, plan again and overwrite it
            log.warning("ignoring plan cache file %s: %s; planning again", path, exc)
            return None
        log.info("plan cache: reusing the %s plan in %s", entry.plan.planner, path)
        try:
            os.utime(path)  # recently used: pruned last
        except OSError:
            pass
        return entry

    @staticmethod
    def _decode(doc: Any, key: str) -> CachedPlan:
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"format {found!r}, not {FORMAT!r}")
        if doc.get("version") != PLAN_CACHE_VERSION:
            raise ValueError(f"version {doc.get('version')!r}, this turnip reads {PLAN_CACHE_VERSION}")
        if doc.get("key") != key:
            raise ValueError("written for another key")
        walk = doc.get("walk")
        if walk not in WALKS:
            raise ValueError(f"unknown walk {walk!r}")
        plan = Codec(PLAN_TYPES).decode(doc.get("plan"), {})
        return CachedPlan(plan, walk, _finite_or_none(doc.get("simulated_step_s")))

    def store(self, key: str, entry: CachedPlan, about: dict | None = None) -> Path | None:
        """Write the entry (atomically); a failure to write is logged, never raised."""
        path = self.path(key)
        try:
            doc = {"format": FORMAT, "version": PLAN_CACHE_VERSION, "key": key, "about": about or {},
                   "plan": Codec(PLAN_TYPES).encode(entry.plan), "walk": entry.walk,
                   "simulated_step_s": _finite_or_none(entry.simulated_step_s)}
            text = json.dumps(doc, allow_nan=False, separators=(",", ":"), default=str)
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".plan-", suffix=".json")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except (OSError, TypeError, ValueError) as exc:
            log.warning("could not store the plan in the plan cache (%s: %s)", path, exc)
            return None
        log.info("plan cache: stored the %s plan in %s", entry.plan.planner, path)
        self._prune()
        return path

    def _prune(self) -> None:
        """Keep the MAX_ENTRIES most recently written or read entries."""
        try:
            files = sorted(self.directory.glob("*.json"), key=lambda p: p.stat().st_mtime)
            for old in files[:-MAX_ENTRIES]:
                old.unlink(missing_ok=True)
        except OSError:  # another compile pruned first
            pass
