"""A MemGraph's state saved and loaded sharded through ``torch.distributed.checkpoint`` (DCP).

Every rank writes its share (the weights it owns and their optimizer states) into one checkpoint,
laid out as ``torch.distributed.checkpoint.state_dict`` lays out an eager model's and optimizer's:

    {"model": {fqn: tensor},
     "optim": {"state": {fqn: {"step": ..., "exp_avg": ..., ...}},
               "param_groups": [{"lr": ..., ..., "params": [fqn, ...]}]},
     "step": the steps taken}

So torch's own helpers load it into an eager model and optimizer (``dcp.load`` into
``get_model_state_dict`` / ``get_optimizer_state_dict``, then ``set_model_state_dict`` /
``set_optimizer_state_dict``), and `load_checkpoint` loads it, or one those helpers wrote, into a
MemGraph compiled over any number of ranks, or in one process: entries are keyed by parameter name,
and each rank reads those its share needs.
"step" is there because torch keeps no step for SGD's momentum, whose first update differs from the
next ones. A checkpoint written before the first step holds no optimizer states (torch's helpers make
states for an eager optimizer that has none: they then find none to load).

Loading reads tensors only, never the pickled param groups: the hyperparameters of the next step are
``mg.optimizer``'s, as compiled (restore an LR scheduler from its own state dict). DCP itself keeps
its checkpoint's index (``.metadata``) as a pickle, which torch reads: load checkpoints you trust.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

import torch

from ..engine.runtime import initial_step
from ..ir.memgraph import MemGraph
from ..ir.optimizer import CARRIED, HOST_STATES, state_value_name
from .ranks import Ranks

log = logging.getLogger(__name__)

STEP = "step"  # the checkpoint's top-level entry of the steps taken
STEP_VALUE = "opt:step"  # the device copy of the step count a fused update reads (trace/optimizer_update.py)


def save_checkpoint(mg: MemGraph, checkpoint_id: str | os.PathLike) -> None:
    """Write ``mg``'s weights, optimizer states and step count to the DCP checkpoint (a folder)
    ``checkpoint_id``, in the layout of torch's ``get_model_state_dict`` / ``get_optimizer_state_dict``
    (see the module docstring). Every rank of a MemGraph compiled over several calls it and writes its
    own share; one process writes the whole."""
    import torch.distributed.checkpoint as dcp  # here, not at the top: importing it takes about a second

    state = {"model": mg.state_dict(), STEP: torch.tensor(_steps_taken(mg))}
    if mg.optimizer is not None:
        state["optim"] = _optimizer_state(mg)
    _over_ranks(dcp.save, mg, state, checkpoint_id=checkpoint_id)
    log.info("saved %d weights and %d parameters' optimizer states to %s", len(state["model"]),
             len(state.get("optim", {}).get("state", {})), checkpoint_id)


def load_checkpoint(mg: MemGraph, checkpoint_id: str | os.PathLike) -> None:
    """Install the DCP checkpoint ``checkpoint_id`` (written by `save_checkpoint`, or by torch from an
    eager model and optimizer of the same parameters) as ``mg``'s state: the next engine.run goes on
    from its weights, optimizer states and step count. Every rank of a MemGraph compiled over several
    calls it and reads its own share, the weights it owns and their replicas.

    Raises ValueError naming the checkpoint, and on several ranks the rank, before anything changes,
    for a checkpoint the MemGraph does not match: an entry it needs that is missing, of another shape
    or dtype, or a weight of another model."""
    import torch.distributed.checkpoint as dcp  # (see save_checkpoint)

    ranks = Ranks.of(mg.process_group) if mg.process_group is not None else None
    device = torch.device(mg.device)
    model_keys = set(mg.names)
    if ranks is not None:  # a rank's names are its share: the model's are every rank's
        model_keys = model_keys.union(*ranks.exchange(sorted(mg.names), device))
    reader = dcp.FileSystemReader(checkpoint_id)
    try:
        entries = reader.read_metadata().state_dict_metadata
    except OSError as err:
        plan, problem = None, f"not a readable checkpoint ({type(err).__name__}: {err})"
    else:
        plan, problem = _plan(mg, model_keys, entries)
    if ranks is not None:  # every rank refuses alike, or the others would wait in dcp.load
        problems = ranks.exchange(problem, device)
        failed = next((r for r, p in enumerate(problems) if p is not None), None)
        problem = None if failed is None else f"rank {failed}: {problems[failed]}"
    if problem is not None:
        raise ValueError(f"checkpoint {checkpoint_id}: {problem}")
    _over_ranks(dcp.load, mg, plan.request, storage_reader=reader)
    _install(mg, plan)
    log.info("loaded %d persistent values and step %d from %s", len(plan.values), plan.step(), checkpoint_id)


def _steps_taken(mg: MemGraph) -> int:
    """Updates the MemGraph's step has applied (those of its optimizer before compile included)."""
    if mg.runtime is not None:
        return int(mg.runtime.step)
    return int(mg.stats.get("step", initial_step(mg)))


def _over_ranks(function, mg: MemGraph, state: dict, **kwargs):
    """dcp.save or dcp.load through ``mg``'s process group; for a MemGraph of one process, in this
    process alone, even where torch.distributed is set up."""
    if mg.process_group is not None:
        return function(state, process_group=mg.process_group, **kwargs)
    with warnings.catch_warnings():  # DCP warns that it assumes one process even when told so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        return function(state, no_dist=True, **kwargs)


def _optimizer_state(mg: MemGraph) -> dict:
    """``mg.optimizer.state_dict()`` keyed by parameter name, as get_optimizer_state_dict keys it."""
    names = [name for group in mg.taskgraph.optimizer.params for name in group]
    exported = mg.optimizer.state_dict()
    return {"state": {names[index]: state for index, state in exported["state"].items()},
            "param_groups": [{**group, "params": [names[index] for index in group["params"]]}
                             for group in exported["param_groups"]]}


@dataclass
class _Plan:
    """What a rank reads: ``request`` (DCP's nested dict of tensors to fill), and where each goes."""

    request: dict
    values: dict[int, tuple]  # persistent value -> the path in ``request`` of the tensor it is made from
    step_path: tuple | None  # the steps taken: the top-level entry, or an eager optimizer's per-parameter one
    carried: dict[int, dict[str, tuple]]  # param group -> {host state: its path} (HOST_STATES)

    def tensor(self, path: tuple) -> torch.Tensor:
        node = self.request
        for key in path:
            node = node[key]
        return node

    def step(self) -> int:
        return 0 if self.step_path is None else int(self.tensor(self.step_path).item())


def _plan(mg: MemGraph, model_keys: set[str], entries: dict) -> tuple[_Plan | None, str | None]:
    """What this rank reads from a checkpoint of ``entries`` (DCP's metadata: flat key -> storage),
    or the first reason it cannot."""
    plan = _Plan({}, {}, None, {})
    values = mg.taskgraph.values
    persistent = sorted(set(mg.initial_state) | set(mg.homes))
    optimizer_values = _optimizer_values(mg, persistent)
    # states are there for every updated parameter once the optimizer has stepped, and none before
    stepped = any(key.startswith("optim.state.") for key in entries)
    for vid in persistent:
        value = values[vid]
        if vid in optimizer_values:
            if not stepped:
                continue
            path, cast = ("optim", "state", *optimizer_values[vid]), False
        else:
            fqn, cast = _model_name(value.name)
            if fqn not in model_keys:  # a constant, a buffer the model's state_dict leaves out
                continue
            path = ("model", fqn)
        problem = _request(plan, entries, path, tuple(value.shape), None if cast else value.dtype)
        if problem is not None:
            return None, f"{problem} (this MemGraph's {value.name})"
        plan.values[vid] = path
    extra = sorted(key for key in entries if key.startswith("model.") and key.removeprefix("model.") not in model_keys)
    if extra:
        return None, f"holds {extra[0]!r}, which this MemGraph's model does not have ({len(extra)} such entries)"
    return plan, _request_counts(mg, plan, entries)


def _optimizer_values(mg: MemGraph, persistent: list[int]) -> dict[int, tuple[str, str]]:
    """{value id: (parameter name, state key)} of the optimizer states among ``persistent``."""
    spec = mg.taskgraph.optimizer
    if mg.optimizer is None or spec is None:
        return {}
    by_name = {mg.taskgraph.values[vid].name: vid for vid in persistent}
    found = {}
    for name in (n for group in spec.params for n in group):
        for key in spec.state_keys():
            vid = by_name.get(state_value_name(name, key))
            if vid is not None:
                found[vid] = (name, key)
    return found


def _request_counts(mg: MemGraph, plan: _Plan, entries: dict) -> str | None:
    """Add to ``plan`` the steps taken and, for a kind with HOST_STATES, each param group's host states
    (the same for every parameter of a group: read from the first the checkpoint holds); or why not."""
    spec = mg.taskgraph.optimizer if mg.optimizer is not None else None
    groups = spec.params if spec is not None else []
    if STEP in entries:
        plan.step_path = (STEP,)
    else:  # an eager optimizer's checkpoint: the step of any parameter it updated
        plan.step_path = next((("optim", "state", n, "step") for group in groups for n in group
                               if f"optim.state.{n}.step" in entries), None)
    if plan.step_path is not None:
        problem = _request(plan, entries, plan.step_path, (), None)
        if problem is not None:
            return problem
    for g, group in enumerate(groups):
        for key in HOST_STATES.get(spec.kind, ()):
            holder = next((n for n in group if f"optim.state.{n}.{key}" in entries), None)
            if holder is not None:
                path = ("optim", "state", holder, key)
                problem = _request(plan, entries, path, (), None)
                if problem is not None:
                    return problem
                plan.carried.setdefault(g, {})[key] = path
    return None


def _model_name(value_name: str) -> tuple[str | None, bool]:
    """The model's state_dict key a persistent value holds ("param:fc.weight"), also for a replica of
    it on another device ("replica1:param:fc.weight", trace/data_parallel.py) or its copy in a
    narrower dtype ("param:fc.weight:bfloat16", trace/half_width.py, the second item True); None for
    the others."""
    if value_name.startswith("replica"):
        value_name = value_name.partition(":")[2]
    kind, _, rest = value_name.partition(":")
    if kind not in ("param", "buffer"):
        return None, False
    fqn, _, dtype = rest.partition(":")
    return fqn, bool(dtype)


def _request(plan: _Plan, entries: dict, path: tuple, shape: tuple, dtype: torch.dtype | None) -> str | None:
    """Add the tensor at ``path`` to ``plan.request`` (once), shaped as the checkpoint holds it; or why
    not: missing, not a tensor, or of another shape (or dtype, unless ``dtype`` is None)."""
    from torch.distributed.checkpoint import TensorStorageMetadata  # (see save_checkpoint)

    key = ".".join(path)  # DCP's flat key of a nested entry
    entry = entries.get(key)
    if entry is None:
        return f"no entry {key!r}"
    if not isinstance(entry, TensorStorageMetadata):  # BytesStorageMetadata: an object DCP pickled
        return f"entry {key!r} is not a tensor"
    held, held_dtype = tuple(entry.size), entry.properties.dtype
    if held != shape or (dtype is not None and held_dtype != dtype):
        return (f"entry {key!r} is {list(held)} {str(held_dtype).removeprefix('torch.')}, expected "
                f"{list(shape)} {str(dtype or held_dtype).removeprefix('torch.')}")
    node = plan.request
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node.setdefault(path[-1], torch.empty(held, dtype=held_dtype))
    return None


def _install(mg: MemGraph, plan: _Plan) -> None:
    """The loaded tensors as ``mg``'s state, as ``release()`` keeps one: the next engine.run starts from
    them. Values the checkpoint does not hold (constants) keep what the runtime had."""
    mg.release()
    step = plan.step()
    loaded = {}
    for vid, path in plan.values.items():
        loaded[vid] = plan.tensor(path).to(mg.taskgraph.values[vid].dtype)  # a narrower copy as compile casts it
    for value in mg.taskgraph.values:
        if value.name == STEP_VALUE and value.id in mg.initial_state:
            loaded[value.id] = torch.tensor(float(step), dtype=value.dtype)
    # new objects, not updates in place (see release)
    mg.initial_state = {**mg.initial_state, **loaded}
    mg.stats = {**mg.stats, "step": step}
    spec = mg.taskgraph.optimizer
    for g, paths in plan.carried.items():
        # the host states after the loaded step, as torch kept them (scalars() records them so too)
        spec.groups[g].setdefault(CARRIED, {})[step] = {key: plan.tensor(path).item() for key, path in paths.items()}
