"""The contracts between turnip's stages, as plain data: a leaf that imports nothing else of turnip.

    TaskGraph  (taskgraph.py)  traced ATen ops over dense tensor values      memgraph.trace -> planners
    Plan       (plan.py)       keep / offload / recompute, homes, order      planners -> memgraph.build
    MemGraph   (memgraph.py)   vertices at fixed arena places, typed edges   memgraph.build -> engine

Every other package (kernels, planners, memgraph, engine, bench) imports from here, never
the other way, so the flow trace -> plan -> MemGraph -> engine reads in one direction.
"""

from .errors import InfeasibleBudget
from .memgraph import Edge, Kind, MemGraph, MVertex, Place, Stream
from .optimizer import OptimizerSpec
from .plan import CPU, GPU, Plan, Recompute
from .taskgraph import TaskGraph, TensorRef, Value, ValueKind, Vertex

__all__ = ["CPU", "GPU", "Edge", "InfeasibleBudget", "Kind", "MVertex", "MemGraph", "OptimizerSpec", "Place", "Plan", "Recompute",
           "Stream", "TaskGraph", "TensorRef", "Value", "ValueKind", "Vertex"]
