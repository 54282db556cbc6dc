"""Run a MemGraph: ``engine.run(mg, batch)`` -> the step's outputs.

The event loop (loop.py) launches every ready vertex whose stream and
resources are free; backends (cpu.py, cuda.py) execute vertices and signal
completions. See DESIGN.md, "Runtime contract".
"""

from turnip.engine.errors import BatchError, EngineError, ResourceError, StallError, VertexError
from turnip.engine.policy import DeterministicPolicy, Policy, RandomPolicy, SerialPolicy
from turnip.engine.run import run
from turnip.engine.timing_sim import simulate

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
]
