"""turnip: train a PyTorch step bigger than the GPU, with eager PyTorch's numbers.

    from turnip import memgraph, engine
    mg = memgraph.compile(model, loss_fn, batch, optimizer=opt, budget="6GiB")
    out = engine.run(mg, batch)

From a shell: python -m turnip {demo,info,plot,bench} (python -m turnip --help).
"""

__version__ = "0.1.0"

# memgraph first: kernels and planners import its data types, and importing the
# package in this order means no submodule ever sees a half-initialized one.
from . import (
    engine,
    memgraph,
)

__all__ = ["engine", "memgraph"]
