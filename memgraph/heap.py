"""The Python heap while compile runs: the cyclic collector looks only at what compile makes."""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collect_young_only():
    """Everything alive on entry goes to the collector's permanent generation (gc.freeze) until
    exit, so collections during compile traverse the objects compile makes, not the whole
    program's (torch, transformers and the model: about 450,000 objects beside the 30M GPT-2 of
    bench/compile_time.py, where one full collection took 0.23-0.29 s of a 2-core CPU; its compile
    with the greedy planner, this on and off in turn in one process: medians 1.51-1.54 s against
    1.77-1.91). Garbage that existed on entry is collected after
    exit. A program that froze objects itself (gc.get_freeze_count()) is left as it is, since
    gc.unfreeze would thaw its objects too."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
