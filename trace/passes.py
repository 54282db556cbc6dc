"""The TaskGraph passes after tracing, as one ordered list.

Each pass takes the traced graph and returns the rewritten one (the same object where it rewrites in
place). ``step_passes`` says which run, and in which order, for a traced step; compile reuses the
same passes on a graph kept undonated (it splits the loss head of that graph when its budget needs it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from ..ir.taskgraph import TaskGraph
from .cat_in_place import write_concats_in_place
from .donate import donate_dying_inputs
from .half_width import halve_frozen_casts
from .split_loss import split_loss_head


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    apply: Callable[[TaskGraph], TaskGraph]


def _in_place(rewrite: Callable[[TaskGraph], object]) -> Callable[[TaskGraph], TaskGraph]:
    def apply(tg: TaskGraph) -> TaskGraph:
        rewrite(tg)
        return tg
    return apply


CAT_IN_PLACE = Pass("concatenations written in place", write_concats_in_place)
HALF_WIDTH = Pass("frozen weights kept half width", _in_place(halve_frozen_casts))
DONATE = Pass("buffer donation", _in_place(donate_dying_inputs))


def split_loss(blocks: int) -> Pass:
    return Pass(f"loss head in {blocks} row blocks", lambda tg: split_loss_head(tg, blocks))


def step_passes(loss_blocks: int | None = None, donate: bool = True) -> list[Pass]:
    """The passes trace applies, in order: the loss head split first (it rewrites the traced ops of
    the head), then concatenations in place, half-width frozen weights, and buffer donation last
    (it sees every op's final inputs)."""
    passes = [split_loss(loss_blocks)] if loss_blocks is not None and loss_blocks >= 2 else []
    passes += [CAT_IN_PLACE, HALF_WIDTH]
    return passes + [DONATE] if donate else passes


def run_passes(tg: TaskGraph, passes: Sequence[Pass]) -> TaskGraph:
    """``tg`` after each pass in order, validated once at the end."""
    for rewrite in passes:
        tg = rewrite.apply(tg)
    tg.validate()
    return tg
