"""A traced step without its tensors: the TaskGraph's structure, shapes and per-vertex costs.

A ``.step`` file is the MemGraph file format (ir/serialize.py: a zip of tagged JSON and a
safetensors member, no pickle) holding one TaskGraph whose initial state (the model's weights)
is left out, so a 1B-parameter step is a few MB. With the op times and workspace the cost model
measured on the GPU kept in each vertex, planning and the timing simulator run from it on any
machine, for the GPU it was measured on: planner research without the GPU
(bench/replan.py). It cannot run: the engine needs the weights.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from . import serialize
from .memgraph import FILE_TYPES
from .taskgraph import TaskGraph


def save_step(tg: TaskGraph, path: str | Path) -> None:
    """Write ``tg`` without its tensors (initial state, tensor batch constants) to ``path``."""
    constants = {k: v for k, v in tg.batch_constants.items() if not hasattr(v, "untyped_storage")}
    serialize.save(dataclasses.replace(tg, initial_state={}, batch_constants=constants), path, FILE_TYPES)


def load_step(path: str | Path) -> TaskGraph:
    """Read a step written by `save_step`; ValueError for any other file."""
    tg = serialize.load(path, FILE_TYPES)
    if not isinstance(tg, TaskGraph):
        raise ValueError(f"{path} holds a {type(tg).__name__}, not a traced step (TaskGraph)")  # noqa: TRY004
    return tg
