"""A batch checked against the traced example before any work: its structure, its tensors' shapes,
dtypes and devices, its constants; the one place a batch is matched to ``TaskGraph.batch_inputs``."""

from __future__ import annotations

import math

import torch
from torch.utils import _pytree as pytree

from .errors import BatchError
from .taskgraph import batch_leaf_names, flatten_batch_structure


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _input_name(value, leaf: int) -> str:
    return value.name.removeprefix("batch:") if value.name else f"leaf {leaf}"


def _structure(spec) -> str:
    """A batch structure in one line: its leaves' paths."""
    names = batch_leaf_names(spec)
    return f"leaves {', '.join(names)}" if names else "no leaves"


def _same_constant(got, want) -> bool:
    if type(got) is not type(want):
        return False
    return got == want or (isinstance(want, float) and math.isnan(want) and math.isnan(got))


def _size_hint(leaf: torch.Tensor, value) -> str:
    """Advice when only the first (batch) dimension differs."""
    if leaf.dtype != value.dtype or leaf.dim() != len(value.shape) or leaf.dim() == 0 \
            or tuple(leaf.shape[1:]) != tuple(value.shape[1:]):
        return ""
    if leaf.shape[0] < value.shape[0]:
        return (" (a last, partial batch? use DataLoader(..., drop_last=True), or compile a MemGraph for "
                "this batch size too)")
    return " (another batch size than the traced example's: compile a MemGraph for this batch size)"


def _devices_taken(device: str) -> tuple[str, ...]:
    """Device types a step on `device` reads batch tensors from: its own, and on CUDA host memory too
    (each leaf is copied into the arena, so a DataLoader's CPU batch needs no .to("cuda") first)."""
    kind = str(device).split(":")[0]
    return (kind, "cpu") if kind == "cuda" else (kind,)


def _device_advice(device: str) -> str:
    kind = str(device).split(":")[0]
    if kind == "cuda":
        return "pass tensors on the GPU or in host memory (a 'meta' tensor has no data to train on)"
    return f"move the batch with .to({kind!r}) (a 'meta' tensor has no data to train on)"


def check_batch(tg, batch) -> list[torch.Tensor]:
    """The batch's tensor leaves in the order of ``tg.batch_inputs``, after checking the batch against
    the traced example: the same structure (lists and tuples alike, dict keys in any order), tensors
    of the same shapes and dtypes on a device the step reads (its own; on CUDA host memory too), and
    non-tensor leaves (compile-time constants) equal. A step that accumulates gradients over k
    micro-batches (``tg.accumulation_steps``) takes a list or tuple of k batches, each checked so. Raises BatchError, one line naming the input, otherwise."""
    if tg.devices > 1:
        return _check_devices(tg, batch)
    steps = tg.accumulation_steps
    if steps == 1:
        return _check_one(tg, tg.batch_inputs, batch, "")
    if not isinstance(batch, (list, tuple)) or hasattr(batch, "_fields") or len(batch) != steps:
        got = f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (list, tuple)) \
            else f"a {type(batch).__name__}"
        raise BatchError(f"this MemGraph accumulates gradients over {steps} micro-batches (compiled with "
                         f"accumulation_steps={steps}): engine.run takes a list of {steps} batches, each like the "
                         f"example batch, got {got}")
    per = len(tg.batch_inputs) // steps
    tensors = []
    for micro, part in enumerate(batch):
        tensors += _check_one(tg, tg.batch_inputs[micro * per:(micro + 1) * per], part,
                              f"micro-batch {micro} of {steps}: ")
    return tensors


def _check_devices(tg, batch) -> list[torch.Tensor]:
    """check_batch for a step on several devices: a list or tuple of one batch per device, each like
    the example, or one batch whose every tensor holds the devices' batches one after another
    along dim 0 (split evenly, device 0's rows first)."""
    count = tg.devices
    per = len(tg.batch_inputs) // count
    example_like = (isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields") and len(batch) == count
                    and all(flatten_batch_structure(part)[1] == tg.batch_spec for part in batch))
    if example_like:
        tensors = []
        for device, part in enumerate(batch):
            tensors += _check_one(tg, tg.batch_inputs[device * per:(device + 1) * per], part,
                                  f"the batch of device {device} of {count}: ")
        return tensors
    leaves, spec = flatten_batch_structure(batch)
    if tg.batch_spec is not None and spec != tg.batch_spec:
        raise BatchError(f"this MemGraph runs on {count} devices: engine.run takes a list of {count} batches, each "
                         f"like the example batch, or one batch like it with {count} times its rows; got "
                         f"{_structure(spec)}, expected {_structure(tg.batch_spec)} (or a list of {count} of them)")
    parts: list[list] = [[] for _ in range(count)]
    expected = iter(tg.values[v] for v in tg.batch_inputs[:per])
    for i, leaf in enumerate(leaves):
        if i in tg.batch_constants or not isinstance(leaf, torch.Tensor):
            for part in parts:
                part.append(leaf)
            continue
        value = next(expected, None)
        rows = value.shape[0] if value is not None and value.shape else None
        if rows is None or leaf.dim() == 0 or leaf.shape[0] != rows * count:
            got = tuple(leaf.shape)
            raise BatchError(f"batch input '{_input_name(value, i) if value is not None else i}' (leaf {i}) has shape "
                             f"{got}: one batch for {count} devices holds {count} x the example's rows along dim 0 "
                             f"({count} x {rows} = {rows * count if rows else '?'}), split evenly, device 0's first; "
                             f"or pass a list of {count} batches")
        for part, piece in zip(parts, leaf.split(rows)):
            part.append(piece)
    tensors = []
    for device, part in enumerate(parts):
        tensors += _check_one(tg, tg.batch_inputs[device * per:(device + 1) * per],
                              pytree.tree_unflatten(part, spec), f"the batch of device {device} of {count}: ")
    return tensors


def _check_one(tg, inputs: list[int], batch, where: str) -> list[torch.Tensor]:
    """check_batch for one batch like the example, whose tensors are the values `inputs`; `where`
    starts every message (the micro-batch)."""
    leaves, spec = flatten_batch_structure(batch)
    expected = [tg.values[v] for v in inputs]
    constants = tg.batch_constants
    if len(leaves) != len(expected) + len(constants):
        if tg.batch_spec is not None:
            names = ", ".join(batch_leaf_names(tg.batch_spec)) or "none"
        else:
            names = ", ".join(repr(_input_name(v, i)) for i, v in enumerate(expected)) or "none"
        raise BatchError(f"{where}batch has {len(leaves)} leaves, the traced example had "
                         f"{len(expected) + len(constants)} ({names})")
    if tg.batch_spec is not None and spec != tg.batch_spec:
        got, want = _structure(spec), _structure(tg.batch_spec)
        if got == want:  # same paths, other containers (a named tuple for a tuple, say)
            got, want = repr(pytree.tree_unflatten([0] * spec.num_leaves, spec)), \
                repr(pytree.tree_unflatten([0] * tg.batch_spec.num_leaves, tg.batch_spec))
        raise BatchError(f"{where}batch structure differs from the traced example's: {got}, expected {want}")
    names = batch_leaf_names(tg.batch_spec) if tg.batch_spec is not None else None
    tensors = []
    it = iter(expected)
    for i, leaf in enumerate(leaves):
        if i in constants:
            want = constants[i]
            if not _same_constant(leaf, want):
                raise BatchError(f"{where}batch input '{names[i] if names else i}' (leaf {i}) is a constant of the "
                                 f"compiled step: traced with {want!r} ({type(want).__name__}), got {leaf!r} "
                                 f"({type(leaf).__name__}); pass it as a tensor, or compile again for this value")
            continue
        value = next(it)
        want = f"shape {tuple(value.shape)} {_dtype_name(value.dtype)}"
        name = _input_name(value, i)
        if not isinstance(leaf, torch.Tensor):
            raise BatchError(f"{where}batch input '{name}' (leaf {i}): expected a tensor of {want}, "
                             f"got {type(leaf).__name__}")
        if tuple(leaf.shape) != tuple(value.shape) or leaf.dtype != value.dtype:
            raise BatchError(f"{where}batch input '{name}' (leaf {i}): expected {want}, "
                             f"got {tuple(leaf.shape)} {_dtype_name(leaf.dtype)}{_size_hint(leaf, value)}")
        if leaf.device.type not in _devices_taken(tg.device):
            raise BatchError(f"{where}batch input '{name}' (leaf {i}) is on device '{leaf.device}', and this "
                             f"MemGraph runs on '{tg.device}': {_device_advice(tg.device)}")
        tensors.append(leaf)
    return tensors
