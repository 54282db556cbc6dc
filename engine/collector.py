"""Python's cyclic garbage collector held off while a step runs.

The loop allocates a few objects per launch (reports, records), so the collector's youngest
generation fills every few hundred launches and each collection stops the loop thread while it
runs. A 24-layer GPT step on two virtual CPU devices (8,370 launches) ran 11-14 young collections
and 1-2 of the middle generation during every step, about 4 ms of a 2-core CPU a step, and one
collection of the oldest generation (the compile's objects) took 0.25 s inside the first step
(``python bench/results/h200x2/s18/offline/gc_probe.py 0.3 ilp``); paused, none ran inside a step
(``tests/test_engine_cpu.py::test_the_cyclic_collector_does_not_run_during_a_step``). On CUDA the
loop is the host's only launcher: while it collects, no stream gets new work. torchtitan and
Megatron-LM turn the automatic collector off around their training steps for the same reason.

The collector is disabled for the step and enabled again after it, only where it was enabled: a
program that turned it off keeps it off. Cycles made during a step (few: the loop's objects are
freed by reference counting) are collected by the next automatic collection after the step.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collector_paused():
    """No automatic cyclic collection inside the block; the collector's state as before after it."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
