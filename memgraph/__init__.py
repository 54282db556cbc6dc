"""The two graphs and the compiler between them.

    tg = memgraph.trace(model, loss_fn, batch, optimizer=opt)   # TaskGraph
    mg = memgraph.build(tg, plan)                               # MemGraph
    memgraph.verify(mg)                                         # [] when valid
    mg = memgraph.compile(model, loss_fn, batch, optimizer=opt, budget="6GiB")
    print(mg); print(memgraph.dump(mg))                         # one line; the vertices
"""

from turnip.ir.describe import dump
from turnip.ir.errors import InfeasibleBudget
from turnip.ir.memgraph import MemGraph, load
from turnip.ir.taskgraph import TaskGraph
from turnip.memgraph.build import build
from turnip.memgraph.compile import compile
from turnip.memgraph.errors import UnsupportedFeature, UnsupportedOp
from turnip.memgraph.reference import ReferenceExecutor
from turnip.memgraph.trace import trace
from turnip.memgraph.verify import verify

__all__ = ["InfeasibleBudget", "MemGraph", "ReferenceExecutor", "TaskGraph", "UnsupportedFeature", "UnsupportedOp",
           "build", "compile", "dump", "load", "trace", "verify"]
