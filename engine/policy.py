"""Launch priorities: which ready vertex goes first when several could.

A policy gives every MemGraph vertex a rank (smaller launches first) and
says whether launches are *strict*: launched in rank order within each stream
class, a vertex waiting for every earlier one of its class to launch (the
deterministic ablation of the runtime contract). Non-strict policies only
break ties among vertices that are ready and whose resources are free, so any
rank gives a valid order; that is what lets the random policy fuzz the orders
a MemGraph permits.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)

ORDERINGS = ("nondeterministic", "deterministic", "random")


def serial_positions(mg) -> list[int]:
    """Rank of each vertex = its position in mg.serial.

    mg.serial lists MemGraph vertex ids; vertices it leaves out (none, for a
    built MemGraph) go after it in id order so a hand-made graph still runs.
    """
    n = len(mg.vertices)
    rank = [-1] * n
    pos = 0
    for vid in mg.serial:
        if not 0 <= vid < n:
            raise ValueError(f"mg.serial names vertex {vid}, but the MemGraph has {n} vertices")
        if rank[vid] >= 0:
            raise ValueError(f"mg.serial lists vertex {vid} twice")
        rank[vid] = pos
        pos += 1
    if pos < n:
        log.debug("mg.serial leaves out %d of %d vertices; appending them in id order", n - pos, n)
        for vid in range(n):
            if rank[vid] < 0:
                rank[vid] = pos
                pos += 1
    return rank


class Policy:
    """Base policy: earliest in mg.serial first, not strict (the default, nondeterministic ordering)."""

    name = "nondeterministic"
    strict = False
    cache_key: str | None = None  # ranks that depend only on the MemGraph may be cached under this key

    def ranks(self, mg) -> list[int]:
        return serial_positions(mg)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class SerialPolicy(Policy):
    """Nondeterministic ordering: launch whatever is ready, earliest in mg.serial first."""

    cache_key = "serial"


class DeterministicPolicy(Policy):
    """Launch strictly in mg.serial order within each stream class (ablation)."""

    name = "deterministic"
    strict = True
    cache_key = "serial"


class RandomPolicy(Policy):
    """Seeded random priorities: fuzzes that every permitted order gives the same bytes."""

    name = "random"

    def __init__(self, seed: int | None = None):
        if seed is None:
            seed = int(np.random.SeedSequence().entropy % (2**31))
            log.info("random ordering with seed %d (pass seed=%d to repeat it)", seed, seed)
        self.seed = seed

    def ranks(self, mg) -> list[int]:
        return np.random.default_rng(self.seed).permutation(len(mg.vertices)).tolist()

    def __repr__(self) -> str:
        return f"RandomPolicy(seed={self.seed})"


def make_policy(ordering: str | Policy, seed: int | None = None) -> Policy:
    if isinstance(ordering, Policy):
        return ordering
    if ordering == "nondeterministic":
        return SerialPolicy()
    if ordering == "deterministic":
        return DeterministicPolicy()
    if ordering == "random":
        return RandomPolicy(seed)
    raise ValueError(f"ordering must be one of {ORDERINGS} or a turnip.engine.Policy, not {ordering!r}")
