"""Errors raised before any work is done, each naming what to change."""

from __future__ import annotations

from dataclasses import dataclass


class UnsupportedFeature(ValueError):
    """The model, loss or optimizer uses something turnip cannot trace or reproduce exactly."""


@dataclass(frozen=True)
class SourceLine:
    """A line of the user's code (or of a library it calls): where a refused op was run from."""

    file: str
    line: int
    text: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" + (f" `{self.text}`" if self.text else "")


def describe_place(module: str | None, module_type: str = "", phase: str = "forward") -> str:
    """Where an op runs, in the user's terms: `module 'blocks.0.attn' (Attention)`, `the model's
    forward (GPT)` for the top module, `loss_fn` outside every module, and the backward pass of any
    of these."""
    kind = f" ({module_type})" if module_type else ""
    if module is None:
        place = "loss_fn" if phase == "forward" else ""
    elif module == "":
        place = f"the model's own forward{kind}"
    else:
        place = f"module '{module}'{kind}"
    if phase == "backward":
        return f"the backward pass of {place}" if place else "the backward pass"
    return place


class UnsupportedOp(UnsupportedFeature):
    """An op of the traced step that cannot be reproduced. The message names the op, where it runs
    (``module``: the module path, "" for the model's own forward, None outside every module, in
    loss_fn) and ``source``, the line of code that ran it (the innermost frame outside torch and
    turnip; None when unknown; for an op of the backward pass, the line that ran it or, with
    ``forward_source``, the forward call it differentiates); ``why`` says what is wrong and what to do instead."""

    def __init__(self, op: str, module: str | None, why: str, *, module_type: str = "",
                 source: SourceLine | None = None, phase: str = "forward", forward_source: bool = False):
        self.op, self.module, self.why = op, module, why
        self.module_type, self.source, self.phase = module_type, source, phase
        # forward_source: a backward op's source is the forward call it differentiates
        at = "" if source is None else f", differentiating {source}" if forward_source else f", at {source}"
        super().__init__(f"op {op} in {describe_place(module, module_type, phase)}{at}: {why}")


class EagerRefusal(UnsupportedOp, RuntimeError):
    """What eager PyTorch itself refuses (a dtype mismatch a meta kernel lets through): a
    RuntimeError as eager's, and an UnsupportedOp naming the op, module and line; eager's own
    exception is its ``__cause__``."""
