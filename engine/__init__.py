"""Run a MemGraph: ``engine.run(mg, batch)`` -> the step's outputs.

The event loop (loop.py) launches every ready vertex whose stream and
resources (resources.py) are free; the shared runtime (runtime.py) decodes
each vertex once and dispatches it by kind (decode.py) to its backend's hook
(cpu.py, cuda.py), which runs it and signals its completion; timing_sim.py
replays the same loop on a virtual clock (ranks_sim.py: every rank's at once). See docs/design.md, "Runtime
contract".
"""

from .errors import BatchError, EngineError, ResourceError, StallError, VertexError
from .policy import DeterministicPolicy, Policy, RandomPolicy, SerialPolicy
from .ranks_sim import simulate_ranks
from .run_step import run
from .timing_sim import simulate

__all__ = [
    "BatchError",
    "DeterministicPolicy",
    "EngineError",
    "Policy",
    "RandomPolicy",
    "ResourceError",
    "SerialPolicy",
    "StallError",
    "VertexError",
    "run",
    "simulate",
    "simulate_ranks",
]
