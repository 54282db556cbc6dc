"""Errors that more than one stage raises: the planner and the builder both refuse a budget."""

from __future__ import annotations


class InfeasibleBudget(ValueError):
    """The plan's GPU budget is below what the step can ever run in.

    ``minimum`` is the smallest GPU budget (bytes) that builds with this plan,
    ``vertex`` the TaskGraph vertex needing it (-1 when none is to blame),
    ``resource`` "gpu", or "cpu" when no GPU budget helps because pinned CPU
    storage (plan.cpu_budget) is too small; ``minimum`` is then the CPU bytes
    the CPU homes alone need.
    """

    def __init__(self, message: str, minimum: int, vertex: int = -1, resource: str = "gpu"):
        super().__init__(message)
        self.minimum = minimum
        self.vertex = vertex
        self.resource = resource


class EngineError(RuntimeError):
    """Base class: the step did not complete; the engine is still usable."""


class BatchError(EngineError, ValueError):
    """The batch does not match the traced example (leaf count, shape, dtype)."""
