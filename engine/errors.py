"""Exceptions raised by engine.run.

Every failure of a step is one of these, so a caller can catch
``EngineError`` and keep using the MemGraph: the engine drains in-flight
work before raising and never leaves a step half-launched.
"""

from __future__ import annotations

from typing import Any


class EngineError(RuntimeError):
    """Base class: the step did not complete; the engine is still usable."""


class BatchError(EngineError, ValueError):
    """The batch does not match the traced example (leaf count, shape, dtype)."""


class ResourceError(EngineError):
    """A vertex asks for more than the engine can ever give it (workspace, streams)."""


class StallError(EngineError):
    """Nothing is ready, nothing is in flight, and vertices are left: the MemGraph cannot finish."""

    def __init__(self, message: str, stuck: list[int]):
        super().__init__(message)
        self.stuck = stuck


class VertexError(EngineError):
    """A vertex raised while running. ``__cause__`` is the original exception."""

    def __init__(self, message: str, vertex: int, kind: str, op: str = "", module: str = "",
                 inputs: list[tuple[int, Any, Any]] | None = None):
        super().__init__(message)
        self.vertex = vertex
        self.kind = kind
        self.op = op
        self.module = module
        self.inputs = inputs or []  # (value id, shape, dtype)


def describe_vertex(mg, vid: int) -> dict:
    """What a user needs to find a failing vertex: kind, op, module and the values it reads."""
    mv = mg.vertices[vid]
    tg = mg.taskgraph
    info = {"vertex": vid, "kind": mv.kind.value, "op": "", "module": "", "inputs": []}
    if mv.task_vertex >= 0 and mv.task_vertex < len(tg.vertices):
        tv = tg.vertices[mv.task_vertex]
        info["op"] = tv.op
        info["module"] = tv.module
        read_ids = tv.inputs()
    else:
        read_ids = list(mv.reads) or ([mv.value] if mv.value >= 0 else [])
    for val in read_ids:
        if 0 <= val < len(tg.values):
            value = tg.values[val]
            info["inputs"].append((val, tuple(value.shape), value.dtype))
        else:
            info["inputs"].append((val, None, None))
    return info


def format_vertex(info: dict) -> str:
    parts = [f"vertex {info['vertex']} ({info['kind']}"]
    if info["op"]:
        parts.append(f" {info['op']}")
    parts.append(")")
    if info["module"]:
        parts.append(f" in module '{info['module']}'")
    if info["inputs"]:
        ins = ", ".join(f"value {v} {list(s) if s is not None else '?'} {d}" for v, s, d in info["inputs"])
        parts.append(f" reading [{ins}]")
    return "".join(parts)
