"""Typed tensor views over byte buffers (the arena, the pinned CPU storage)."""

from __future__ import annotations

import torch

from ..ir.taskgraph import TensorRef, Value


def typed_view(buffer: torch.Tensor, offset: int, value: Value) -> torch.Tensor:
    """The dense tensor of `value` whose storage starts at byte `offset` of a uint8 `buffer`."""
    itemsize = torch.empty((), dtype=value.dtype).element_size()
    if offset % itemsize:
        raise ValueError(f"offset {offset} of value {value.id} is not aligned to its {itemsize}-byte dtype")
    raw = buffer[offset: offset + value.nbytes]
    if raw.numel() != value.nbytes:
        raise ValueError(f"value {value.id} ({value.nbytes} bytes at {offset}) overruns a {buffer.numel()}-byte buffer")
    flat = raw.view(value.dtype)
    return flat.as_strided(value.shape, value.stride, flat.storage_offset())


def ref_view(base: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    """Apply a TensorRef's size/stride/offset to the dense tensor of its value."""
    if tuple(base.shape) == tuple(ref.size) and tuple(base.stride()) == tuple(ref.stride) and ref.storage_offset == 0:
        return base
    return base.as_strided(ref.size, ref.stride, base.storage_offset() + ref.storage_offset)

