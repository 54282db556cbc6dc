"""The ATen ops a function runs on fake tensors, in call order: what the tracer reads.

``make_fx`` records the same ops as an FX graph, through a proxy per tensor, and that bookkeeping
costs more than the fake ops themselves (a 30M GPT-2's step on a 2-core CPU: 1.4 s through make_fx,
0.5 s of fake ops). The tracer needs less: each op, its arguments as they were when it ran (each
tensor's storage, shape, stride and offset), its results, and, for the library checks answered as
eager (constant_checks.py), which op made each tensor. ``Recorder`` keeps that and records what
make_fx records: a lift of a fresh constant is recorded as a copy (``lift_fresh_copy``), so a later
in-place write never reaches the constant; an op that reached the mode undecomposed (autograd
bypassed) with a CompositeImplicitAutograd decomposition and no kernel for its device runs and is
recorded as its decomposition; ``bool(tensor)`` records its comparison and scalar read;
``prim.device`` is answered unrecorded. ``recording`` turns the autocast cache off as make_fx does,
so every cast autocast makes of a weight is an op of the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from ..kernels.ops import flatten_returns

aten = torch.ops.aten
_ANSWERED = (torch.ops.prim.device.default,)  # asked of a tensor, not computed: make_fx records none
_NEVER_DECOMPOSED = (aten.size.default, aten.stride.default, aten.storage_offset.default)
_UNKNOWN = (-1, 0)  # (node, output) of a fake tensor made outside the recording (a .data alias)


# Seen and Arg are dataclasses, not named tuples: pytree (and the reader) would open a tuple.
@dataclasses.dataclass(frozen=True, slots=True)
class Seen:
    """A tensor as an op saw it: its storage (``storage``: a key unique among the live tensors of
    the recording) and its layout then."""

    storage: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    nbytes: int  # of the whole storage


@dataclasses.dataclass(frozen=True, slots=True)
class Arg:
    """A tensor argument of a recorded op: how the op saw it, and which output of which node made it
    (node -1: a fake tensor the recording did not make)."""

    seen: Seen
    node: int
    output: int


def seen(t: torch.Tensor, keep: list | None = None) -> Seen:
    """How t looks now; its storage appended to ``keep`` (if given) to keep its key unique."""
    storage = t.untyped_storage()
    if keep is not None:
        keep.append(storage)
    return Seen(storage._cdata, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, storage.nbytes())


class Node:
    """One entry of the recording. kind "input": a tensor given to the recorded function (``value``);
    "constant": a real tensor an op read (``value``, made by the function: torch.tensor(...));
    "op": an ATen op (``target``) with its ``args`` and ``kwargs`` as called, each tensor an Arg,
    and ``returns``, its results flattened (kernels/ops.py flatten_returns), each tensor a Seen.
    An op's results are not kept: a reference to one would change what autograd does with it
    (AccumulateGrad copies a gradient someone else holds instead of taking it)."""

    __slots__ = ("args", "kind", "kwargs", "returns", "target", "value")

    def __init__(self, kind: str, target=None, args=(), kwargs=None, returns=(), value=None):
        self.kind, self.target, self.args, self.kwargs = kind, target, args, kwargs or {}
        self.returns, self.value = returns, value

    def arguments(self) -> list[Arg]:
        """The op's tensor arguments, in the order of its flattened args and kwargs."""
        return [a for a in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(a, Arg)]


class NotAten(Exception):
    """A higher-order operator reached the recording: the step would run it as Python, not ATen."""

    def __init__(self, op):
        self.op = op
        super().__init__(f"{op} is not an ATen op")


@functools.cache
def _decomposes(func: torch._ops.OpOverload, device_type: str) -> bool:
    """Whether autograd would have run the op's CompositeImplicitAutograd decomposition: it has one
    and no kernel for the device (torch.utils._python_dispatch.autograd_would_have_decomposed)."""
    if func in _NEVER_DECOMPOSED:
        return False
    if not func.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
        return False
    backend = torch._C._parse_dispatch_key(torch._C._dispatch_key_for_device(device_type))
    return not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), backend)


class Recorder(TorchDispatchMode):
    """Records every ATen op run under it (on the fake tensors of a FakeTensorMode entered before it)
    as a Node, after ``add_input`` has numbered the function's inputs."""

    supports_higher_order_operators = True  # so a higher-order operator is refused, not dispatched

    def __init__(self):
        super().__init__()
        self.nodes: list[Node] = []
        self._made = WeakTensorKeyDictionary()  # tensor -> (node, output) that made it; weak, as make_fx's
        # every storage seen, alive to the end (as make_fx's node values keep theirs): a key of a storage
        # freed and its address reused would name two storages
        self.storages: list = []
        self._paused = 0

    def __len__(self) -> int:
        return len(self.nodes)

    def add_input(self, t: torch.Tensor) -> None:
        self._made[t] = (len(self.nodes), 0)
        self.nodes.append(Node("input", returns=[seen(t, self.storages)], value=t))

    @contextlib.contextmanager
    def paused(self):
        """Ops run inside are not recorded (checks run on real values)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def made(self, t: torch.Tensor) -> tuple[int, int]:
        """(node, output) that made tensor t; node -1 for one the recording did not make."""
        return self._made.get(t, _UNKNOWN)

    def _argument(self, t: torch.Tensor) -> Arg:
        where = self._made.get(t)
        if where is None:
            if isinstance(t, FakeTensor):
                where = _UNKNOWN
            else:  # a real tensor made by the function (torch.tensor's argument to lift_fresh)
                where = (len(self.nodes), 0)
                self._made[t] = where
                self.nodes.append(Node("constant", returns=[seen(t, self.storages)], value=t))
        return Arg(seen(t, self.storages), *where)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused or func in _ANSWERED:
            return func(*args, **kwargs)
        if not isinstance(func, torch._ops.OpOverload):
            raise NotAten(func)
        if func is aten.lift_fresh.default:
            func = aten.lift_fresh_copy.default
        if func is aten.is_nonzero.default:
            with self:
                return (args[0] != 0).item()
        flat, spec = pytree.tree_flatten((args, kwargs))
        first = next((x for x in flat if isinstance(x, torch.Tensor)), None)
        if first is not None and _decomposes(func, first.device.type):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        recorded = [self._argument(x) if isinstance(x, torch.Tensor) else x for x in flat]
        out = func(*args, **kwargs)
        index = len(self.nodes)
        returns = flatten_returns(out)
        rec_args, rec_kwargs = pytree.tree_unflatten(recorded, spec)
        self.nodes.append(Node("op", func, rec_args, rec_kwargs,
                               [seen(t, self.storages) if isinstance(t, torch.Tensor) else t for t in returns]))
        for k, t in enumerate(returns):
            if isinstance(t, torch.Tensor):
                self._made[t] = (index, k)
        return out


@contextlib.contextmanager
def recording(recorder: Recorder):
    """The recorder on, with the autocast cache off (make_fx's ``disable_autocast_cache``): a cached
    cast would be a tensor no op of the recording made."""
    cached = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        with recorder:
            yield recorder
    finally:
        torch.set_autocast_cache_enabled(cached)
