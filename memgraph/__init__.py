"""The two graphs and the compiler between them.

    tg = memgraph.trace(model, loss_fn, batch, optimizer=opt)   # TaskGraph
    mg = memgraph.build(tg, plan)                               # MemGraph
    memgraph.verify(mg)                                         # [] when valid
    mg = memgraph.compile(model, loss_fn, batch, optimizer=opt, budget="6GiB")
    print(mg); print(memgraph.dump(mg))                         # one line; the vertices
"""

from ..engine.reference import ReferenceExecutor
from ..ir.describe import dump
from ..ir.errors import InfeasibleBudget
from ..ir.memgraph import MemGraph, load
from ..ir.taskgraph import TaskGraph
from ..trace.errors import UnsupportedFeature, UnsupportedOp
from ..trace.tracer import trace
from .builder import build
from .checker import verify
from .checkpoint import load_checkpoint, save_checkpoint
from .compiler import compile
from .ranks import gather_optimizer_state_dict, gather_state_dict

__all__ = ["InfeasibleBudget", "MemGraph", "ReferenceExecutor", "TaskGraph", "UnsupportedFeature", "UnsupportedOp",
           "build", "compile", "dump", "gather_optimizer_state_dict", "gather_state_dict", "load", "load_checkpoint",
           "save_checkpoint", "trace", "verify"]
