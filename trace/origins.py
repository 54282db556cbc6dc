"""Where traced nodes come from, for refusals that point at the user's code.

While loss_fn runs, ``Origins`` (a TorchFunctionMode) marks the nodes each torch call adds to the
recording (trace/recorder.py) with
the module running and the user's source line (the innermost frame outside torch, turnip and the
standard library), and the autograd nodes it makes carry the same mark into the backward pass;
a call mixing floating-point dtypes is first put to eager (``_eager_refusal``). ``data_dependent_refusal``
turns torch's data-dependent errors into an UnsupportedOp at the same place (in a Hugging Face
experts module, naming the experts implementations that compile), ``kernel_refusal`` the inputs an
op's kernels refuse (kernels/ops.py KERNEL_LAYOUTS), ``not_aten_refusal`` a higher-order operator.
The ATen ops alone say none of this: the user's lines are Python frames above the dispatcher.
"""

from __future__ import annotations

import functools
import linecache
import os
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import NamedTuple

import torch
import torch.fx.experimental.symbolic_shapes
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.overrides import TorchFunctionMode

from ..kernels.ops import op_name
from .errors import EagerRefusal, SourceLine, UnsupportedOp

DATA_DEPENDENT = tuple(
    exc for exc in (
        getattr(torch._subclasses.fake_tensor, "DataDependentOutputException", None),
        getattr(torch._subclasses.fake_tensor, "DynamicOutputShapeException", None),
        getattr(torch.fx.experimental.symbolic_shapes, "GuardOnDataDependentSymNode", None),
    ) if exc is not None
)



# Code whose frames are not the user's: a refusal points at the innermost frame outside them (the
# user's line, or the line of a library such as transformers that the user's model runs). Torch and
# turnip by package, the standard library by folder (a user's own trace.py or test.py is the user's).
_NOT_USER = frozenset({"torch", "functorch", __name__.partition(".")[0]})
_STDLIB = tuple({os.path.join(os.path.realpath(sysconfig.get_paths()[key]), "")
                 for key in ("stdlib", "platstdlib")})


def _is_user_frame(frame) -> bool:
    if frame.f_globals.get("__name__", "").partition(".")[0] in _NOT_USER:
        return False
    file = frame.f_code.co_filename
    if file.startswith("<frozen "):
        return False
    return not (file.startswith(_STDLIB) and "-packages" + os.sep not in file)


def live_frames(frame):
    """(frame, line) from `frame` outwards: the live stack, innermost first."""
    while frame is not None:
        yield frame, frame.f_lineno
        frame = frame.f_back


def raised_frames(exc: BaseException):
    """(frame, line) of an exception's traceback, innermost (where it was raised) first."""
    return reversed(list(traceback.walk_tb(exc.__traceback__)))


def user_place(frames) -> tuple[str, int] | None:
    """(file, line) of the first of `frames` (innermost first) outside torch, turnip and the
    standard library; None when every frame is theirs."""
    for frame, line in frames:
        if _is_user_frame(frame):
            return frame.f_code.co_filename, line
    return None


def source_line(place: tuple[str, int] | None) -> SourceLine | None:
    if place is None:
        return None
    file, line = place
    return SourceLine(file, line, linecache.getline(file, line).strip())


class Origin(NamedTuple):
    """Where traced nodes come from: the module running (None: loss_fn, outside the model), the
    user's (file, line) that made them, and the phase ("backward" for the nodes an autograd node of
    that forward call adds)."""

    module: str | None
    place: tuple[str, int] | None
    phase: str = "forward"


_ORIGIN_KEY = "turnip.origin"  # on an autograd node's metadata: the Origin of the call that made it


def _function_name(func) -> str:
    """A torch function as users write it: torch.nn.functional.linear, torch.Tensor.__add__."""
    name = getattr(func, "__name__", None) or repr(func)
    try:
        resolved = torch.overrides.resolve_name(func)
    except Exception:  # noqa: BLE001 - only a name for a message
        resolved = None
    if resolved and resolved.rpartition(".")[2] == name:
        return resolved
    owner = getattr(func, "__objclass__", None)
    return f"torch.{owner.__name__}.{name}" if owner is not None else f"torch.{name}"


def _floating(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def _tensor_args(args, kwargs):
    """The tensors among a call's arguments (and in its lists and tuples, one level down)."""
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, torch.Tensor):
            yield arg
        elif isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, torch.Tensor):
                    yield item


def _substitutes(x, dtype: torch.dtype | None = None):
    """Real tensors standing in for a call's fake ones: zeros of the same shape, dtype and device
    that take no memory (a broadcast scalar); floating-point ones in `dtype` when given."""
    if isinstance(x, torch.Tensor):
        want = dtype if dtype is not None and _floating(x) else x.dtype
        return torch.zeros((), dtype=want, device=x.device).expand(x.shape)
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_substitutes(item, dtype) for item in x)
    if isinstance(x, dict):
        return {k: _substitutes(v, dtype) for k, v in x.items()}
    return x


_EAGER_VERDICTS: dict = {}  # (function, argument dtypes, devices) -> eager's exception, or None where it accepts


def _eager_refusal(func, args, kwargs, tensors: list[torch.Tensor], recorder) -> Exception | None:
    """Eager's exception when it refuses this call for its mix of floating-point dtypes, None when
    it accepts it. Fake tensors run meta kernels, and some of them (mm, addmm, layer_norm's CPU
    kernel, index_add_, nll_loss's weight, ...) do not check dtypes as the device kernels do, so a
    float64 model given a float32 batch would trace where eager raises. The call is run as eager
    would run it, on real zeros of the same shapes (broadcast, no memory) on the same devices, once
    with the dtypes given and, when that raises, once with every floating-point tensor in one dtype:
    only a call that fails the first way and runs the second is refused, so a failure of the
    substitutes themselves (an in-place write into a broadcast zero) is never blamed on the dtypes.
    Answers are kept per function and dtypes (they do not depend on shapes).

    CPU tensors only, for now: on a GPU the substitutes' results would take device memory before
    the arena is allocated, which no GPU run has measured yet (a mix there traces as before)."""
    if any(t.device.type != "cpu" for t in tensors):
        return None
    try:
        key = (func, tuple((t.dtype, t.device.type) for t in tensors))
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _EAGER_VERDICTS:
        return _EAGER_VERDICTS[key]
    uniform = next(t.dtype for t in tensors if _floating(t))
    cuda = sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str)
    verdict = None
    with unset_fake_temporarily(), recorder.paused(), torch._C.DisableTorchFunction(), \
            torch.no_grad(), torch.random.fork_rng(devices=cuda):  # a random op must not move eager's generators
        try:
            func(*_substitutes(args), **_substitutes(kwargs))
        except Exception as mixed:  # noqa: BLE001 - eager's refusal, whatever its type
            try:
                func(*_substitutes(args, uniform), **_substitutes(kwargs, uniform))
            except Exception:  # noqa: BLE001 - fails with one dtype too: not the dtypes' doing
                verdict = None
            else:
                verdict = mixed
    if key is not None:
        _EAGER_VERDICTS[key] = verdict
    return verdict


class Origins(TorchFunctionMode):
    """Where the traced nodes come from, for refusals. While loss_fn runs, each torch call that adds
    nodes to the recording marks them with the module running and the user's line that made the call
    (the innermost frame outside torch, turnip and the standard library); the autograd nodes it
    makes carry the same mark, so the nodes their backward adds get it too, as phase "backward".
    A call mixing floating-point dtypes is first put to eager (_eager_refusal): what eager refuses
    is refused here too, as eager's error."""

    def __init__(self, modules, recorder):
        super().__init__()
        self.modules = modules
        self.recorder = recorder  # trace/recorder.py: its length is the number of nodes recorded so far
        self.spans: list[tuple[int, Origin | None]] = []  # (first node index, origin of the nodes from there on)
        self.failed_in: Origin | None = None  # where the forward was when an exception left it
        self.last: Origin | None = None  # the origin of the last call seen that added nodes

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and self.failed_in is None:
            self.failed_in = Origin(self.modules.path(), None)
        return super().__exit__(exc_type, exc, tb)

    def mark(self, index: int, origin: Origin | None) -> None:
        if self.spans and index < self.spans[-1][0]:
            return  # no graph to count nodes in here: spans stay in node order
        if self.spans and self.spans[-1][0] == index:
            self.spans.pop()
        if not self.spans or self.spans[-1][1] != origin:
            self.spans.append((index, origin))

    def at(self, index: int) -> Origin | None:
        found = None
        lo, hi = 0, len(self.spans)
        while lo < hi:  # the last span starting at or before index
            mid = (lo + hi) // 2
            if self.spans[mid][0] <= index:
                found, lo = self.spans[mid][1], mid + 1
            else:
                hi = mid
        return found

    def last_backward(self) -> Origin | None:
        for _, origin in reversed(self.spans):
            if origin is not None and origin.phase == "backward":
                return origin
        return None

    def _backward_of(self, origin: Origin, _grad_outputs) -> None:
        self.mark(len(self.recorder), origin._replace(phase="backward"))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = list(_tensor_args(args, kwargs))
        if len({t.dtype for t in tensors if _floating(t)}) > 1:
            refused = _eager_refusal(func, args, kwargs, tensors, self.recorder)
            if refused is not None:
                module = self.modules.path()
                kinds = ", ".join(f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}" for t in tensors)
                raise EagerRefusal(
                    _function_name(func), module,
                    f"eager PyTorch refuses these inputs too, with {type(refused).__name__}: {refused} (tensor "
                    f"inputs: {kinds}); give them one dtype as eager needs (the model's and the batch's: "
                    f"model.to(dtype), or the batch's tensors .to(dtype))",
                    module_type=self.modules.type_name(module),
                    source=source_line(user_place(live_frames(sys._getframe(1))))) from refused
        before = len(self.recorder)
        result = func(*args, **kwargs)
        after = len(self.recorder)
        if after != before:
            origin = Origin(self.modules.path(), user_place(live_frames(sys._getframe(1))))
            self.mark(before, origin)
            self.mark(after, None)
            # an input made by a call not seen here (a custom autograd.Function's apply, whose forward
            # ran the last call seen) takes that call's origin
            self.adopt(tensors)
            for out in (result if isinstance(result, (tuple, list)) else (result,)):
                if isinstance(out, torch.Tensor):
                    self._tag(out.grad_fn, origin)
            self.last = origin
        return result

    def adopt(self, tensors) -> None:
        """Give the autograd nodes of `tensors` that no seen call made the last seen call's origin."""
        if self.last is not None:
            for t in tensors:
                self._tag(t.grad_fn, self.last)

    def _tag(self, grad_fn, origin: Origin) -> None:
        if grad_fn is not None and _ORIGIN_KEY not in grad_fn.metadata:
            grad_fn.metadata[_ORIGIN_KEY] = origin
            grad_fn.register_prehook(functools.partial(self._backward_of, origin))


_DATA_DEPENDENT_WHY = {  # by op, without its overload
    "aten::_local_scalar_dense": "reads a tensor's value on the host (.item(), float(), int() or bool() of a "
                                 "tensor, or an if, while or assert on one)",
    "aten::nonzero": "makes a tensor whose shape depends on tensor values (nonzero, boolean-mask indexing "
                     "x[mask])",
    "aten::masked_select": "makes a tensor whose shape depends on tensor values (masked_select, x[mask])",
    "aten::_ctc_loss": "is CTC loss, whose output sizes depend on the values of the target lengths",
}


def _failed_at(err: Exception, origins: Origins) -> tuple[str | None, SourceLine | None, str, bool]:
    """Where an exception raised inside the trace came from: (module, source line, phase, whether the
    line is the forward call a backward op differentiates). The line is the innermost frame of its
    traceback outside torch, turnip and the standard library; the module the one running when it
    left loss_fn, or in the backward pass the module of the forward call differentiated."""
    source = source_line(user_place(raised_frames(err)))
    if origins.failed_in is not None:  # raised while loss_fn ran
        return origins.failed_in.module, source, "forward", False
    last = origins.last_backward()
    forward_source = source is None and last is not None
    if forward_source:
        source = source_line(last.place)
    return (last.module if last is not None else None), source, "backward", forward_source


def _experts_module(model: torch.nn.Module, path: str | None) -> torch.nn.Module | None:
    """The Hugging Face experts module at `path` or above it (a class decorated by transformers'
    use_experts_implementation, whose forward, defined in transformers/integrations/moe.py whatever
    the version, reads config._experts_implementation at each call), else None."""
    while path is not None:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            return None
        code = getattr(getattr(type(module), "forward", None), "__code__", None)
        decorated = code is not None and Path(code.co_filename).parts[-3:] == ("transformers", "integrations", "moe.py")
        if decorated and getattr(getattr(module, "config", None), "_experts_implementation", None):
            return module
        path = path.rpartition(".")[0] if path else None
    return None


_EXPERTS_SWITCH = ("from_pretrained(..., experts_implementation=...), a config's experts_implementation=..., or "
                   "model.set_experts_implementation(...)")


def experts_advice(model: torch.nn.Module, path: str | None, refused: str) -> str:
    """For an op refused in a Hugging Face mixture-of-experts block: the experts implementation it
    runs and the ones to load the model with instead ("" outside such a block). `refused` is why
    ("data-dependent": the "eager" loop over the experts chosen; "kernel": an op eager refuses)."""
    module = _experts_module(model, path)
    if module is None:
        return ""
    impl = module.config._experts_implementation
    names = " or ".join(f'"{name}"' + (" (transformers' default)" if name == "grouped_mm" else "")
                        for name in ("grouped_mm", "batched_mm") if name != impl)
    runs = f"{type(module).__name__} runs transformers' experts implementation \"{impl}\""
    if refused == "data-dependent":
        return (f"{runs}, whose loop visits only the experts the tokens chose, a number known only from the "
                f"routing: load the model with experts_implementation={names}, whose shapes do not "
                f"depend on the routing ({_EXPERTS_SWITCH})")
    return f"{runs}; experts_implementation={names} computes the experts without this call ({_EXPERTS_SWITCH})"


def data_dependent_refusal(err: Exception, origins: Origins) -> UnsupportedOp:
    """A data-dependent error raised by torch inside the trace, as a refusal naming the op, the module
    running and the line that called it (the innermost frame of its traceback outside torch, turnip
    and the standard library)."""
    func = getattr(err, "func", None)
    op = op_name(func) if isinstance(func, torch._ops.OpOverload) else "(a value computed from tensors)"
    module, source, phase, forward_source = _failed_at(err, origins)
    why = _DATA_DEPENDENT_WHY.get(op.partition(".")[0], "has a result or an output shape that depends on tensor "
                                                         "values")
    advice = experts_advice(origins.modules.model, module, "data-dependent") or (
        "compute with ops whose shapes do not depend on values (torch.where, multiplying by a mask, clamp), or "
        "check the data before the step, not inside it")
    return UnsupportedOp(op, module, f"it {why}, which a static step graph cannot express (it depends on tensor "
                         f"values): {advice}",
                         module_type=origins.modules.type_name(module), source=source, phase=phase,
                         forward_source=forward_source)


def kernel_refusal(err: Exception, origins: Origins) -> EagerRefusal:
    """What eager's own kernel refuses (kernels/ops.py KernelRefusal, found by the layout the trace
    uses for the op), as eager's error naming the op, the module and the line."""
    module, source, phase, forward_source = _failed_at(err, origins)
    advice = experts_advice(origins.modules.model, module, "kernel")
    return EagerRefusal(getattr(err, "op", "(an op)"), module,
                        f"eager PyTorch's kernel refuses these inputs too: {err}" + (f". {advice}" if advice else ""),
                        module_type=origins.modules.type_name(module), source=source, phase=phase,
                        forward_source=forward_source)


def not_aten_refusal(err: Exception, origins: Origins) -> UnsupportedOp:
    """A higher-order operator (torch.cond, flex attention, ...) met by the recording
    (trace/recorder.py NotAten), as a refusal naming it, the module running and the line."""
    module, source, phase, forward_source = _failed_at(err, origins)
    return UnsupportedOp(str(getattr(err, "op", "(an operator)")), module,
                         "is not an ATen op: turnip runs ATen ops only (a higher-order operator runs Python of "
                         "its own, which a step of ATen ops cannot replay)",
                         module_type=origins.modules.type_name(module), source=source, phase=phase,
                         forward_source=forward_source)
