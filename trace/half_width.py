"""Half-width frozen weights: a frozen weight the step reads only through casts to one narrower
floating dtype is kept, and fetched, in that dtype.

Under autocast a frozen fp32 weight (a LoRA base matrix, a model run for inference in fp32) is read
only by ``aten::_to_copy(w, dtype=torch.bfloat16)``: every use converts the same 4 bytes per
element to the same 2. The cast of a frozen value gives the same bits every step and on every
device (round to nearest even), so it is done once, at compile, on the host: the TaskGraph gets a
frozen bf16 value (its initial state ``w.to(torch.bfloat16)``), the casts read it instead (a cast
of a bf16 tensor to bf16 copies it: the same bits as before), and the fp32 original is read by
nothing, so it takes no place (memgraph/schedule.py) while ``mg.state_dict()`` still returns it.
A weight homed on the CPU then crosses the link at half the bytes, and one kept on the GPU takes
half the memory. Nothing else changes: results stay bitwise equal to eager's.
"""

from __future__ import annotations

import logging

import torch

from ..ir.taskgraph import TaskGraph, TensorRef, ValueKind, map_refs

log = logging.getLogger(__name__)

_CAST = "aten::_to_copy"
# keyword arguments autocast's cast passes that do not change which bits it produces
_PLAIN_CAST_KWARGS = {"dtype", "layout", "device", "pin_memory", "non_blocking", "memory_format"}


def halve_frozen_casts(tg: TaskGraph) -> int:
    """Rewrite tg in place as the module docstring says; returns the number of weights halved."""
    readers: dict[int, list] = {}
    for vertex in tg.vertices:
        for x in vertex.inputs():
            readers.setdefault(x, []).append(vertex)
    bound = set(tg.bindings) | set(tg.outputs.values())
    halved = 0
    for val in list(tg.values):
        if val.kind is not ValueKind.FROZEN or val.id in bound or val.id not in tg.initial_state:
            continue
        dtype = _only_cast_dtype(tg, val, readers.get(val.id, []))
        if dtype is None:
            continue
        new = tg.add_value(val.shape, val.stride, dtype, val.nbytes * dtype.itemsize // val.dtype.itemsize,
                           ValueKind.FROZEN, name=f"{val.name}:{_dtype_name(dtype)}", device=val.device)
        tg.initial_state[new] = tg.initial_state[val.id].detach().to(dtype)

        def swap(ref: TensorRef, old=val.id, new=new) -> TensorRef:
            return TensorRef(new, ref.size, ref.stride, ref.storage_offset) if ref.value == old else ref

        for vertex in readers[val.id]:
            vertex.args = map_refs(vertex.args, swap)
        halved += 1
    if halved:
        log.info("%d frozen weights read only through a cast kept in the cast's dtype", halved)
    return halved


def half_width_values(tg: TaskGraph) -> list[int]:
    """The frozen values halve_frozen_casts made: each named after its original and its dtype."""
    return [val.id for val in tg.values if val.kind is ValueKind.FROZEN and val.dtype.is_floating_point
            and val.name.endswith(":" + _dtype_name(val.dtype))]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _only_cast_dtype(tg: TaskGraph, val, readers: list) -> torch.dtype | None:
    """The narrower floating dtype every reader casts val to, or None if some reader does anything else."""
    if not readers or not val.dtype.is_floating_point:
        return None
    dtypes = set()
    for vertex in readers:
        if vertex.op != _CAST or len(vertex.args) != 1 or set(vertex.kwargs) - _PLAIN_CAST_KWARGS:
            return None
        device = vertex.kwargs.get("device")
        if device is not None and torch.device(device).type != torch.device(tg.device).type:
            return None
        dtypes.add(vertex.kwargs.get("dtype"))
    if len(dtypes) != 1:
        return None
    (dtype,) = dtypes
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize >= val.dtype.itemsize:
        return None
    return dtype
