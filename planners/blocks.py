"""Repeated blocks of a step (the same layer n times), found once and tied in the ILP.

A block instance is the forward vertices of one element of a module list: the module path up to
the first component that is a number (``blocks.3``, ``model.layers.17``). Instances of one list
whose forward vertices match (module path below the instance, op on the same shapes, strides
and dtypes, in order) form a block class: a transformer's layers, once each. Rockmate and Hiremate
(zhao-thesis-rockmate-hiremate-offmate.txt) plan such a chain block by block; here a block class
restricts the ILP instead (ilp.py, ``_block_rows``): each tied instance takes one of a few
*patterns*, whole-block plans: an option per group (its kind, and which of the group's options of
that kind, by need time: the same relative to every instance) and a home per item, so the solver
chooses among whole-block plans instead of every group's options one by one. block_search.py
finds the patterns worth offering. A pattern fixes every option of the instance, need time
included, so the program over patterns is small: on the H100 export of gpt1.3b at 50% it solved to
its gap in 1-5 s (tied by kind only, with need times left free, it ran past 10 s).

An instance whose layout differs from its class's most common one (which of its vertices have a
group in the Problem, which kinds each group may take, which home items it owns) is left untied:
the first and last layers often differ (what their recomputations may read at the step's ends).
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter, defaultdict
from dataclasses import dataclass

from ..ir.taskgraph import MESSAGE_OPS, TaskGraph, Vertex
from .costs import signature
from .memory import Decisions, Evaluation
from .model import KEEP, Group, Problem

# a module list's element: everything up to the first component that is a number
_ELEMENT = re.compile(r"^((?:[^.]+\.)*?[^.]+)\.(\d+)(?=\.|$)")

# an option of a group, relative to its instance: its kind and its rank among the group's options
# of that kind, counted from the last (they are made in order of need time, and the last is the
# first use after the gap, which every instance has; an instance at the chain's end may have
# fewer earlier ones)
Choice = tuple[str, int]
Pattern = tuple[tuple[Choice, ...], tuple[bool, ...]]  # (a choice per group of the block, CPU home per item)


def choices(group: Group) -> dict[Choice, int]:
    """The group's options by their choice."""
    ranks: Counter = Counter()
    out = {}
    for oi in reversed(range(len(group.options))):
        kind = group.options[oi].kind
        out[kind, ranks[kind]] = oi
        ranks[kind] += 1
    return out


def choice_of(group: Group, option: int) -> Choice:
    """The choice naming one of the group's options (choices, inverted)."""
    return next(choice for choice, oi in choices(group).items() if oi == option)


@dataclass(frozen=True)
class BlockInstance:
    index: int  # the element's number in its module list
    groups: tuple[int, ...]  # the Problem's groups of the block's forward vertices, in program order
    items: tuple[int, ...]  # the block's home items, by their names below the instance, sorted


@dataclass(frozen=True)
class BlockClass:
    path: str  # the module list, e.g. "blocks" or "model.layers"
    instances: tuple[BlockInstance, ...]  # the tied ones (at least two), in program order


def instance_pattern(problem: Problem, instance: BlockInstance, options: list[int], cpu: list[bool]) -> Pattern | None:
    """What a plan (an option per group, evaluate's, and a home per item) does in one instance,
    relative to its block; None where a group of it has no option (a plan that does not fit)."""
    if any(options[g] < 0 for g in instance.groups):
        return None
    return (tuple(choice_of(problem.groups[g], options[g]) for g in instance.groups),
            tuple(bool(cpu[i]) for i in instance.items))


def element_of(module: str) -> tuple[str, int] | None:
    """(module list, element number) a module path lies in, None outside any list."""
    match = _ELEMENT.match(module or "")
    return (match.group(1), int(match.group(2))) if match else None


def _forward_elements(tg: TaskGraph) -> dict[tuple[str, int], list[int]]:
    elements: dict[tuple[str, int], list[int]] = defaultdict(list)
    for vertex in tg.vertices:
        if vertex.phase == "forward":
            element = element_of(vertex.module)
            if element is not None:
                elements[element].append(vertex.id)
    return elements


def _signature(tg: TaskGraph, element: tuple[str, int], vertices: list[int]) -> tuple:
    """Per vertex its module below the element and its op signature (the op on its inputs' and
    outputs' shapes, strides and dtypes: what the op-cost cache keys measured times by). A
    message's tag, its place among the step's messages, differs from layer to layer and is left
    out: a device's share of a step receives each layer's weights alike (memgraph/per_device.py)."""
    below = len(f"{element[0]}.{element[1]}")
    return tuple((tg.vertices[v].module[below:], signature(tg, _untagged(tg.vertices[v]))) for v in vertices)


def _untagged(vertex: Vertex) -> Vertex:
    if vertex.op not in MESSAGE_OPS:
        return vertex
    return dataclasses.replace(vertex, kwargs={k: v for k, v in vertex.kwargs.items() if k != "tag"})


def _items_below(problem: Problem, element: tuple[str, int]) -> dict[str, int]:
    """The home items of one element, by their names with the element's number replaced by '*'."""
    prefix = re.compile(rf"(^|:){re.escape(f'{element[0]}.{element[1]}')}(?=\.|$)")
    out = {}
    for ii, item in enumerate(problem.items):
        relative, found = prefix.subn(rf"\g<1>{element[0]}.*", item.name, count=1)
        if found:
            out[f"{item.kind}/{relative}"] = ii
    return out


def find_blocks(problem: Problem) -> list[BlockClass]:
    """The step's block classes with at least two instances of one layout (see the module docstring)."""
    tg = problem.tg
    group_of = {g.vertex: gi for gi, g in enumerate(problem.groups) if g.forward}
    lists: dict[tuple, list[tuple[str, int]]] = defaultdict(list)
    elements = _forward_elements(tg)
    for element, vertices in elements.items():
        lists[element[0], _signature(tg, element, vertices)].append(element)
    blocks = []
    for (path, _signature_), members in lists.items():
        if len(members) < 2:
            continue
        laid_out = []
        for element in members:
            grouped = [group_of.get(v, -1) for v in elements[element]]
            items = _items_below(problem, element)
            layout = (tuple(g >= 0 for g in grouped),
                      tuple(tuple(sorted({o.kind for o in problem.groups[g].options})) for g in grouped if g >= 0),
                      tuple(sorted(items)))
            instance = BlockInstance(element[1], tuple(g for g in grouped if g >= 0),
                                     tuple(items[name] for name in sorted(items)))
            laid_out.append((layout, instance))
        common, count = Counter(layout for layout, _ in laid_out).most_common(1)[0]
        if count < 2 or not (common[0].count(True) or common[2]):
            continue  # fewer than two alike, or nothing in the block to decide
        # members are in program order: elements were met walking the vertices
        blocks.append(BlockClass(path, tuple(inst for layout, inst in laid_out if layout == common)))
    return blocks


def block_patterns(problem: Problem, block: BlockClass, plans: list[tuple[Decisions, Evaluation]]) -> list[Pattern]:
    """The patterns a tied instance may take: every instance's in each of the given plans (the
    greedy plan's), and keeping the whole block on the GPU; sorted, so one set of plans always
    gives the same program."""
    first = block.instances[0]
    patterns = {(((KEEP, 0),) * len(first.groups), (False,) * len(first.items))}
    for decisions, evaluation in plans:
        patterns.update(instance_pattern(problem, instance, evaluation.options, decisions.cpu)
                        for instance in block.instances)
    patterns.discard(None)
    return sorted(patterns)
