"""Trace a training step into a TaskGraph, then rewrite it with the passes of passes.py.

    tg = trace(model, loss_fn, batch, optimizer=opt)   # TaskGraph (turnip.ir.taskgraph)

tracer.py runs the step through PyTorch's autograd on fake tensors, its ATen ops recorded by
recorder.py, and reads them storage by storage;
optimizer_update.py appends the update, accumulate.py gradient accumulation; passes.py applies
split_loss.py, cat_in_place.py, half_width.py and donate.py in one order. What cannot be
reproduced is refused here (errors.py).
"""

from .errors import UnsupportedFeature, UnsupportedOp
from .tracer import trace

__all__ = ["UnsupportedFeature", "UnsupportedOp", "trace"]
