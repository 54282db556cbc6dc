"""The two graphs and the compiler between them.

    tg = memgraph.trace(model, loss_fn, batch, optimizer=opt)   # TaskGraph
    mg = memgraph.build(tg, plan)                               # MemGraph
    memgraph.verify(mg)                                         # [] when valid
    mg = memgraph.compile(model, loss_fn, batch, optimizer=opt, budget="6GiB")
    print(mg); print(memgraph.dump(mg))                         # one line; the vertices
"""

from ..ir.describe import dump
from ..ir.errors import InfeasibleBudget
from ..ir.memgraph import MemGraph, load
from ..ir.taskgraph import TaskGraph
from .builder import build
from .compiler import compile
from ..trace.errors import UnsupportedFeature, UnsupportedOp
from ..engine.reference import ReferenceExecutor
from ..trace.tracer import trace
from .checker import verify

__all__ = ["InfeasibleBudget", "MemGraph", "ReferenceExecutor", "TaskGraph", "UnsupportedFeature", "UnsupportedOp",
           "build", "compile", "dump", "load", "trace", "verify"]
