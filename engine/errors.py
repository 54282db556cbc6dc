"""Exceptions raised by engine.run.

Every failure of a step is one of these, so a caller can catch
``EngineError`` and keep using the MemGraph: the engine drains in-flight
work before raising and never leaves a step half-launched.
"""

from __future__ import annotations

from typing import Any

from ..ir.errors import BatchError, EngineError

__all__ = ["BatchError", "EngineError", "ResourceError", "StallError", "VertexError"]


class ResourceError(EngineError):
    """A vertex asks for more than the engine can ever give it (workspace beyond the budget, a lock)."""


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
