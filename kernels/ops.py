"""Resolve the op names stored in a TaskGraph back to ATen overloads."""

from __future__ import annotations

import functools

import torch


def op_name(op: torch._ops.OpOverload) -> str:
    """'aten::add.Tensor', or 'aten::mm' for a default overload (inverse of resolve_op)."""
    packet, overload = op._schema.name, op._overloadname
    return packet if overload == "default" else f"{packet}.{overload}"


@functools.cache
def resolve_op(name: str) -> torch._ops.OpOverload:
    namespace, _, rest = name.partition("::")
    packet_name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), packet_name)
        return getattr(packet, overload or "default")
    except (AttributeError, RuntimeError) as err:
        raise ValueError(f"unknown ATen op {name!r} (a synthetic graph cannot be executed)") from err


def is_random(op: torch._ops.OpOverload) -> bool:
    return torch.Tag.nondeterministic_seeded in op.tags
