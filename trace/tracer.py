"""Trace a whole training step (forward, loss, backward, optimizer update) into a TaskGraph.

The forward and backward run on fake tensors of the target device, through the
real autograd engine, so the ATen ops are the ones eager PyTorch runs; recorder.py
records them (what make_fx records, without its FX graph). The recording is then
read storage by storage: an op that
only makes a view becomes a `TensorRef` of its base value; an op that makes a
new storage becomes a vertex with new values; an in-place op stays in place
(see `Vertex.copy_in`), module buffers included (BatchNorm's running statistics
are bound to their last version, like optimizer states). The optimizer update is
appended as functional vertices (optim.py). What the step cannot reproduce is
refused up front: gradient code in loss_fn, activation checkpointing, ops whose
output sizes only the backend knows at run time (fused RNN kernels).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import logging
import math
import numbers
import sys

import torch
import torch.fx.experimental.symbolic_shapes
import torch.utils.checkpoint
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.immutable_collections import immutable_list
from torch.nn.utils.stateless import _reparametrize_module
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..ir.taskgraph import (
    TaskGraph,
    TensorRef,
    ValueKind,
    batch_leaf_names,
    flatten_batch_structure,
    normalized_positions,
)
from ..kernels.ops import (
    HIDDEN_MUTATIONS,
    KERNEL_LAYOUTS,
    RUNTIME_SIZED,
    KernelRefusal,
    is_random,
    op_name,
    out_variant,
    resolve_op,
)
from .accumulate import accumulate, check_steps, loss_outputs, micro_prefix, split
from .constant_checks import eager_answers
from .data_parallel import (
    averaged_gradients,
    check_devices,
    mean_loss,
    place_on_devices,
    trained_weights,
    weight_casts,
)
from .errors import UnsupportedFeature, UnsupportedOp
from .optimizer_update import append_optimizer, clipped_gradients, spec_from_optimizer
from .origins import (
    DATA_DEPENDENT,
    Origin,
    Origins,
    data_dependent_refusal,
    kernel_refusal,
    live_frames,
    not_aten_refusal,
    source_line,
    user_place,
)
from .passes import run_passes, step_passes
from .recorder import Arg, Node, NotAten, Recorder, Seen, recording, seen

log = logging.getLogger(__name__)

_CHECKPOINT_ADVICE = (
    "turnip decides itself what to keep, offload or recompute within the budget: call "
    "model.gradient_checkpointing_disable() (activation_checkpointing_disable() in recent transformers), or "
    "remove the torch.utils.checkpoint call, before compile, and it recomputes where the budget needs it; the "
    "trained numbers are the same")


def _under_checkpoint() -> bool:
    """True when torch.utils.checkpoint is on the call stack: its reentrant form would compute the
    checkpointed parameters' gradients outside the traced backward (they would silently not train),
    its other form recomputes outside the traced step."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == torch.utils.checkpoint.__file__:
            return True
        frame = frame.f_back
    return False


def _refuse_checkpointing(model: torch.nn.Module) -> None:
    """Hugging Face models say so before the trace starts (is_activation_checkpointing, formerly
    is_gradient_checkpointing, which now warns when read)."""
    for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), attr):
            if getattr(model, attr) is True:
                raise UnsupportedFeature(f"the model ({type(model).__name__}) has gradient checkpointing enabled "
                                         f"(gradient_checkpointing_enable()): {_CHECKPOINT_ADVICE}")
            return


class _ModuleTracker:
    """Which module each recorded node came from: forward hooks record node-count intervals."""

    def __init__(self, model: torch.nn.Module, recorder: Recorder):
        self.model = model
        self.node_count = recorder.__len__
        self.stack: list[str] = []
        self.spans: list[tuple[int, str]] = []  # (first node index, innermost module path from there on)
        self._handles = []

    def __enter__(self):
        for name, module in self.model.named_modules():
            def pre(mod, _args, name=name):
                if _under_checkpoint():
                    raise UnsupportedFeature(f"module '{name}' ({type(mod).__name__}) runs under "
                                             f"torch.utils.checkpoint (activation checkpointing, as set up by "
                                             f"Hugging Face's gradient_checkpointing_enable()): {_CHECKPOINT_ADVICE}")
                self.stack.append(name)
                self.spans.append((self.node_count(), name))

            def post(_mod, _args, _out):
                self.stack.pop()
                self.spans.append((self.node_count(), self.stack[-1] if self.stack else ""))

            self._handles.append(module.register_forward_pre_hook(pre))
            self._handles.append(module.register_forward_hook(post))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()

    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def path(self) -> str | None:
        """The innermost module running now: its path ("" for the model itself), None outside the model."""
        return self.stack[-1] if self.stack else None

    def type_name(self, path: str | None) -> str:
        """The class of the module at `path` ("" outside the model)."""
        if path is None:
            return ""
        try:
            return type(self.model.get_submodule(path)).__name__
        except AttributeError:
            return ""

    def module_at(self, node_index: int) -> str:
        # spans are in node order (the node count only grows): the last one starting at or before the
        # node. A 7B LoRA step has thousands of spans and asks for thousands of nodes.
        found = bisect.bisect_right(self.spans, node_index, key=lambda span: span[0])
        return self.spans[found - 1][1] if found else ""


_GRAD_ACCESS = (torch.Tensor.grad.__get__, torch.Tensor.grad.__set__, torch.Tensor.grad.__delete__)
_BACKWARD = (torch.Tensor.backward, torch.autograd.backward)


def _where(frame) -> tuple[str, str]:
    """(the function running in frame, the first place outside torch, turnip and the standard library
    that led to it)."""
    while frame.f_code.co_filename == torch.overrides.__file__:  # the dispatch to this mode
        frame = frame.f_back
    module = frame.f_globals.get("__name__", "")
    qualname = frame.f_code.co_qualname.split(".<locals>")[0]  # the function, not its comprehension
    name = f"{module}.{qualname}" if module.startswith("torch") else qualname
    found = user_place(live_frames(frame))  # the same first place as every refusal names
    return name, f"{found[0]}:{found[1]}" if found is not None else "torch"


class _GradientGuard(TorchFunctionMode):
    """Refuses, while loss_fn runs, what needs gradients to exist: reading or writing a parameter's
    .grad (clip_grad_norm_, zero_grad, a hand-written clip) and calling backward. In the traced step
    they do not exist yet, so such code would silently do nothing; the step computes the gradients
    and applies clipping and the update itself."""

    def __init__(self, names: dict[int, str]):
        super().__init__()
        self.names = names  # id of a traced parameter -> its name

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _GRAD_ACCESS and id(args[0]) in self.names:
            name, place = _where(sys._getframe(1))
            raise UnsupportedFeature(
                f"loss_fn touches the .grad of parameter '{self.names[id(args[0])]}' (in {name}, from {place}): "
                f"gradients do not exist while the step is traced, so this would silently do nothing. "
                f"loss_fn must only compute the loss; to clip gradients use compile(..., max_grad_norm=..., "
                f"norm_type=...), which clips exactly as torch.nn.utils.clip_grad_norm_ before the update")
        if func in _BACKWARD:
            name, place = _where(sys._getframe(1))
            raise UnsupportedFeature(f"loss_fn calls backward() (in {name}, from {place}): return the loss "
                                     f"and the compiled step runs the backward pass and the update itself")
        return func(*args, **(kwargs or {}))


def _fake_by_layout(name, layout, fake_mode, func, *args, **kwargs):
    """The fake result of op `name` as its kernels make it (kernels/ops.py KERNEL_LAYOUTS)."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    try:
        size, stride, dtype = layout(*args, **kwargs)
    except KernelRefusal as err:
        err.op = name
        raise
    with fake_mode:
        return torch.empty_strided(size, stride, dtype=dtype, device=tensors[0].device)


@contextlib.contextmanager
def _kernel_layouts():
    """While tracing, the ops of KERNEL_LAYOUTS take their kernels' checks and result layout instead
    of their meta kernel's (for aten::_grouped_mm, the meta kernel is the CUDA fast path's and
    refuses float32, which the CPU kernel and CUDA's fallback run: Hugging Face's default experts
    implementation of Mixtral or Qwen2-MoE calls it on float32 models)."""
    table = fake_impls.op_implementations_dict
    saved = {}
    for name, layout in KERNEL_LAYOUTS.items():
        op = resolve_op(name)
        saved[op] = table.get(op)
        table[op] = functools.partial(_fake_by_layout, name, layout)
    try:
        yield
    finally:
        for op, previous in saved.items():
            if previous is None:
                table.pop(op, None)
            else:
                table[op] = previous


def _fake_like(mode, t: torch.Tensor, device: torch.device, requires_grad: bool) -> torch.Tensor:
    with mode:
        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return fake.requires_grad_(requires_grad)


class _GraphReader:
    """Turns the recorded ops into TaskGraph vertices, tracking the current value of every storage."""

    def __init__(self, tg: TaskGraph, modules: _ModuleTracker, origins: Origins,
                 forward_spans: list[tuple[int, int]]):
        self.tg = tg
        self.modules = modules
        self.origins = origins
        self.reading: tuple[str, int] | None = None  # (op, node index) of the node being read, for refusals
        self.forward_spans = forward_spans  # [start, end) node indices of each forward pass (one per micro-batch)
        self.current: dict[int, int] = {}  # storage key -> value id holding its latest version
        self.module_state: dict[int, int] = {}  # buffer input updated in place -> its storage key
        self.vertex_nodes: dict[int, int] = {}  # vertex id -> index of the node it was read from

    def bind_module_state(self) -> None:
        """Each buffer the step updated in place takes its last version at the end of the step."""
        for vid, key in self.module_state.items():
            self.tg.bindings[vid] = self.current[key]

    def bind_input(self, t: Seen, vid: int) -> None:
        if t.storage in self.current:
            raise UnsupportedFeature(f"input {self.tg.values[vid].name} shares storage with another input")
        self.current[t.storage] = vid

    def ref(self, t: Seen) -> TensorRef:
        return TensorRef(self.current[t.storage], t.shape, t.stride, t.offset)

    def template(self, arg):
        if isinstance(arg, Arg):
            return self.ref(arg.seen)
        if isinstance(arg, Seen):
            return self.ref(arg)
        if isinstance(arg, list):  # immutable, as make_fx's nodes held them: a vertex's template is shared by copies
            return immutable_list(self.template(a) for a in arg)
        if isinstance(arg, tuple):
            return type(arg)(self.template(a) for a in arg)
        if isinstance(arg, dict):
            return {k: self.template(a) for k, a in arg.items()}
        if isinstance(arg, torch.SymInt | torch.SymFloat | torch.SymBool):
            why = f"reads a symbolic value {type(arg).__name__} (a value computed from tensors)"
            if self.reading is None:
                raise UnsupportedFeature(f"the traced step {why}")
            raise self.refuse(*self.reading, why)
        return arg

    def new_value(self, t: Seen, name: str = "") -> int:
        vid = self.tg.add_value(t.shape, t.stride, t.dtype, t.nbytes, name=name)
        self.current[t.storage] = vid
        return vid

    def refuse(self, name: str, index: int, why: str) -> UnsupportedOp:
        """The refusal of node `index` (op `name`): its module and the user's line that made it, from
        the origins recorded while tracing; a backward node names the forward call it differentiates."""
        origin = self.origins.at(index)
        if origin is None:  # made outside loss_fn (clipping, the update) or by no recorded call
            forward = any(start <= index < end for start, end in self.forward_spans)
            origin = Origin(self.modules.module_at(index) or None, None, "forward" if forward else "backward")
        return UnsupportedOp(name, origin.module, why, module_type=self.modules.type_name(origin.module),
                             source=source_line(origin.place), phase=origin.phase,
                             forward_source=origin.phase == "backward")

    def read(self, node: Node, index: int) -> None:
        op = node.target
        name = op_name(op)
        self.reading = (name, index)
        phase = "forward" if any(start <= index < end for start, end in self.forward_spans) else "backward"
        module = self.modules.module_at(index) if phase == "forward" else ""
        if name in RUNTIME_SIZED:
            raise self.refuse(name, index, RUNTIME_SIZED[name])
        flat = node.returns
        if any(not (t is None or isinstance(t, Seen) or type(t) in (int, float, bool)) for t in flat):
            raise self.refuse(name, index, "returns a symbolic value (a result that depends on tensor values)")
        results = [t for t in flat if isinstance(t, Seen)]
        mutated = []
        for arg_schema, arg in zip(op._schema.arguments, node.args):
            if arg_schema.alias_info is not None and arg_schema.alias_info.is_write:
                mutated.extend(a.seen for a in (arg if isinstance(arg, (list, tuple)) else [arg]) if isinstance(a, Arg))
        for key, arg in node.kwargs.items():
            schema = next((a for a in op._schema.arguments if a.name == key), None)
            if schema is not None and schema.alias_info is not None and schema.alias_info.is_write \
                    and isinstance(arg, Arg):
                mutated.append(arg.seen)
        if name in HIDDEN_MUTATIONS:  # writes arguments its schema does not mark (BatchNorm's running stats)
            flag, positions = HIDDEN_MUTATIONS[name]
            if len(node.args) > flag and node.args[flag] is True:
                mutated.extend(node.args[i].seen for i in positions
                               if i < len(node.args) and isinstance(node.args[i], Arg))
        if mutated:
            self._read_inplace(node, op, name, module, phase, mutated, flat)
            return
        fresh = [t for t in results if t.storage not in self.current]
        if not fresh:
            return  # a view: folded into the references of its readers
        args, kwargs = self.template(node.args), self.template(node.kwargs)
        outputs = []  # one entry per flattened return, -1 where it is not a new tensor
        for t in flat:
            if not isinstance(t, Seen) or t.storage in self.current:
                outputs.append(-1)
            elif t.offset != 0:
                raise self.refuse(name, index, "returns a tensor that does not start at its storage")
            else:
                outputs.append(self.new_value(t))
        vid = self.tg.add_vertex(name, args, kwargs, outputs, module=module, phase=phase, random=is_random(op))
        self.vertex_nodes[vid] = index

    def _read_inplace(self, node, op, name, module, phase, mutated, flat) -> None:
        """An op that writes some of its arguments: each written argument gets a new version (copy_in).
        When it also returns new tensors (BatchNorm: its output and saved statistics), it runs as its
        out= overload, so every output lands in its own buffer as the launcher expects of in-place ops."""
        keys = []
        for t in mutated:
            key = t.storage
            if key not in self.current:
                raise self.refuse(*self.reading, "writes into a tensor the graph does not know")
            val = self.tg.values[self.current[key]]
            if val.kind is ValueKind.FROZEN and val.name.startswith("buffer:"):
                # module state (BatchNorm's running statistics): updated in place each step, its last
                # version bound to its home like an optimizer state's
                self.module_state.setdefault(val.id, key)
            elif val.kind is not ValueKind.INTERMEDIATE:
                raise self.refuse(*self.reading, f"mutates {val.kind.value} input '{val.name}' in place "
                                    f"(of the step's inputs only module buffers may be updated in place)")
            if key not in keys:
                keys.append(key)
        fresh = [t for t in flat if isinstance(t, Seen) and t.storage not in self.current]
        variant = None
        if fresh:
            try:
                variant = out_variant(name)
            except ValueError:
                variant = None
            if variant is None or len(fresh) != len(flat) or any(t.offset != 0 for t in fresh):
                raise self.refuse(*self.reading, "mutates an argument and also returns a new tensor")
        copy_in, outputs = [], []
        for key in keys:
            old = self.tg.values[self.current[key]]
            new = self.tg.add_value(old.shape, old.stride, old.dtype, old.nbytes)
            self.current[key] = new
            copy_in.append((old.id, new))
            outputs.append(new)
        args, kwargs = self.template(node.args), self.template(node.kwargs)
        if variant is not None:
            op, out_names = variant
            name = op_name(op)
            for out_name, t in zip(out_names, fresh, strict=True):
                vid = self.new_value(t)
                kwargs[out_name] = self.tg.values[vid].dense_ref
                outputs.append(vid)
        vid = self.tg.add_vertex(name, args, kwargs, outputs, module=module, phase=phase, random=is_random(op),
                                 copy_in=tuple(copy_in))
        self.vertex_nodes[vid] = self.reading[1]

    def dense_value(self, ref: TensorRef, module: str = "", phase: str = "backward") -> int:
        """A value id holding exactly `ref` (cloned into its own value when it is a view)."""
        if ref == self.tg.values[ref.value].dense_ref:
            return ref.value
        src = self.tg.values[ref.value]
        meta = torch.empty_strided(ref.size, ref.stride, dtype=src.dtype, device="meta").clone()
        vid = self.tg.add_value(meta.shape, meta.stride(), src.dtype, meta.untyped_storage().nbytes())
        self.tg.add_vertex("aten::clone", (ref,), {}, (vid,), module=module, phase=phase)
        return vid


BACKENDS = ("cpu", "cuda")  # the engine's backends (engine/run_step.py BACKENDS)


def target_device(device) -> torch.device:
    """``device`` as a torch.device the engine has a backend for; a clear error otherwise (tracing
    onto an unknown or unsupported device type can abort the interpreter inside torch)."""
    available = "'cpu'" + (", 'cuda'" if torch.cuda.is_available() else "")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise UnsupportedFeature(f"device {device!r} is not a device torch knows ({err}); turnip runs on "
                                 f"'cpu' or 'cuda' (available here: {available})") from None
    if dev.type not in BACKENDS:
        raise UnsupportedFeature(f"device {str(dev)!r}: turnip has engine backends for 'cpu' and 'cuda' only "
                                 f"(available here: {available})")
    return dev


@dataclasses.dataclass
class TracedStep:
    """A traced step before its last passes and, on several devices, before its vertices are
    placed on them (trace/data_parallel.py): compile finishes it in a second layout without
    tracing again."""
    graph: TaskGraph
    passes: list
    placement: tuple | None = None  # place_on_devices' (count, micro_of, reduce_of, params)

    def casts_weights(self) -> bool:
        """Whether the step, on several devices, casts trained weights in its forward (autocast):
        what finished(casts_travel=True) makes on the owners and sends."""
        return self.placement is not None and bool(
            weight_casts(self.graph, trained_weights(self.graph), self.placement[1]))

    def finished(self, casts_travel: bool = False) -> TaskGraph:
        """The step's TaskGraph, from a copy (this one can be finished again). casts_travel: the
        weights' autocast casts run on their owners and travel to the devices, in place of a
        replica of each weight on every device (data_parallel.weight_casts)."""
        tg = self.graph.copy()
        if self.placement is not None:
            tg = place_on_devices(tg, *self.placement, casts_travel)
        return run_passes(tg, self.passes)


def trace(model: torch.nn.Module, loss_fn, example_batch, **options) -> TaskGraph:
    """The TaskGraph of one training step: ``trace_step(...).finished()``, whose docstring says
    what the options mean."""
    return trace_step(model, loss_fn, example_batch, **options).finished()


def trace_step(model: torch.nn.Module, loss_fn, example_batch, optimizer: torch.optim.Optimizer | None = None,
               device: str | torch.device | None = None, fused_optimizer: bool | None = None,
               max_grad_norm: float | None = None, norm_type: float = 2.0, accumulation_steps: int = 1,
               backward: bool = True, loss_blocks: int | None = None, donate: bool = True,
               devices: int = 1) -> TracedStep:
    """Trace forward, loss, backward and the optimizer update of one training step.

    donate: rewrite ops whose input dies there to write over it (trace/donate.py); False leaves
    the graph as traced (compile splits the loss head of that graph when its budget needs it).

    loss_blocks: k >= 2 splits the loss head (LM head matmul, log-softmax, NLL loss and their backward)
    into k blocks of rows (trace/split_loss.py): equal to eager within float tolerance, not bitwise.

    backward=False traces the forward alone (inference, prefill): ``loss_fn(model, batch)`` is then
    any function returning the outputs to keep, a tensor (step output "output"), a tuple or list of
    tensors ("output:0", "output:1", ...) or a dict of str -> tensor ("output:<key>"); no gradient,
    no update, every parameter read-only. It takes no optimizer, clipping or accumulation.

    accumulation_steps: k > 1 traces eager's gradient accumulation (trace/accumulate.py): k
    forward and backward passes, one per micro-batch like example_batch, each backward adding
    into the gradients in place, then one clipping and update; outputs "losses" (the k losses)
    and "loss" (their sum, added in order).

    devices: N > 1 traces data parallelism over N devices of `device`'s kind (trace/data_parallel.py):
    one forward and backward per device, each on its micro-batch like example_batch, the gradients
    added in device order on each parameter's owner and divided by N (DDP's averaging), one update
    per parameter on its owner; outputs "losses" (the N losses) and "loss" (their mean).

    max_grad_norm: clip the gradients to this total norm before the update, with the arithmetic of
    ``torch.nn.utils.clip_grad_norm_(params, max_grad_norm, norm_type)`` (its total norm, then every
    gradient times min(1, max_norm / (norm + 1e-6))).

    `loss_fn(model, batch)` must return a scalar tensor. Without an optimizer,
    the gradients become step outputs named "grad:<parameter name>".
    fused_optimizer: Adam/AdamW as one fused kernel per parameter (default on CUDA, where eager
    itself uses multi-tensor kernels); off, the update is torch.optim's single-tensor
    implementation op for op, bitwise equal to eager (the CPU default).
    """
    steps = check_steps(accumulation_steps)
    devices = check_devices(devices, steps, backward)
    micros = steps * devices  # micro-batches traced: one per accumulation step, or one per device
    check_clipping(max_grad_norm)
    if not backward:
        _check_forward_only(optimizer, max_grad_norm, steps)
    _refuse_checkpointing(model)
    params = dict(model.named_parameters())
    if device is None:
        device = next(iter(params.values())).device if params else torch.device("cpu")
    device = target_device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        # tracing onto a CUDA device that does not exist aborts the interpreter inside torch: say so first
        raise UnsupportedFeature(f"device {str(device)!r} was asked for, but this torch ({torch.__version__}) "
                                 f"sees no CUDA device; compile with device='cpu' (the CPU backend) or install a "
                                 f"CUDA build of torch on a machine with a GPU")
    spec = spec_from_optimizer(optimizer) if optimizer is not None else None
    group_of = {}
    if optimizer is not None:
        own = {id(p) for p in params.values()}
        for gi, group in enumerate(optimizer.param_groups):
            for k, p in enumerate(group["params"]):
                if id(p) not in own:
                    # it would never be updated: the step trains the model's own parameters only
                    raise UnsupportedFeature(f"the optimizer's param group {gi} holds a tensor of shape "
                                             f"{tuple(p.shape)} (parameter {k} of the group) that is not a "
                                             f"parameter of the model given to compile: build the optimizer "
                                             f"over this model's parameters")
                group_of[id(p)] = gi
        name_of = {id(p): n for n, p in params.items()}
        spec.params = [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    trainable = {n: p for n, p in params.items() if backward and p.requires_grad
                 and (optimizer is None or id(p) in group_of)}
    frozen = {n: p for n, p in params.items() if n not in trainable}
    buffers = dict(model.named_buffers())
    # the batch loss_fn sees has the example's own structure; the step's inputs follow the normalized
    # batch (engine.run flattens every batch that way, so key order and list/tuple do not matter)
    leaves, batch_spec = pytree.tree_flatten(example_batch)
    try:
        order = normalized_positions(example_batch)  # normalized leaf i is leaves[order[i]]
    except ValueError as err:
        raise UnsupportedFeature(f"the example batch's structure is not supported: {err}") from None
    batch_tensors = [j for j in order if isinstance(leaves[j], torch.Tensor)]

    fake_mode = FakeTensorMode()
    fake_train = [_fake_like(fake_mode, p, device, True) for p in trainable.values()]
    fake_frozen = [_fake_like(fake_mode, p, device, False) for p in frozen.values()]
    fake_buffers = [_fake_like(fake_mode, b, device, False) for b in buffers.values()]
    fake_leaves = [_fake_like(fake_mode, leaves[j], device, False) for _ in range(micros) for j in batch_tensors]
    recorder = Recorder()
    modules = _ModuleTracker(model, recorder)
    origins = Origins(modules, recorder)
    marks = {}

    def step(train, froz, bufs, batch_fakes):
        mapping = dict(zip(trainable, train)) | dict(zip(frozen, froz)) | dict(zip(buffers, bufs))
        guard = _GradientGuard({id(t): n for n, t in [*zip(trainable, train), *zip(frozen, froz)]})
        marks["forward"] = []

        def micro_loss(fakes):
            slot = dict(zip(batch_tensors, fakes, strict=True))
            batch = pytree.tree_unflatten([slot.get(j, x) for j, x in enumerate(leaves)], batch_spec)
            start = len(recorder)
            # the guard sees loss_fn's calls first: it names their caller
            with _reparametrize_module(model, mapping, tie_weights=True), modules, origins, guard:
                loss = loss_fn(model, batch)
            _check_loss(loss, loss_fn)
            with torch._C.DisableTorchFunction():
                origins.adopt([loss])  # the loss of a custom autograd.Function
            marks["forward"].append((start, len(recorder)))
            return loss

        if not backward:
            slot = dict(zip(batch_tensors, batch_fakes, strict=True))
            batch = pytree.tree_unflatten([slot.get(j, x) for j, x in enumerate(leaves)], batch_spec)
            start = len(recorder)
            with torch.no_grad(), _reparametrize_module(model, mapping, tie_weights=True), modules, origins:
                named = forward_outputs(loss_fn(model, batch))
            marks["forward"].append((start, len(recorder)))
            marks["outputs"] = [name for name, _ in named]
            return [t for _, t in named]

        per_micro = []  # accumulating: the k losses, an output beside their sum
        marks["micro"], marks["reduce"] = [], []
        if devices > 1:
            losses, per_device = [], []
            for m, fakes in enumerate(split(batch_fakes, devices)):
                start = len(recorder)
                losses.append(micro_loss(fakes))
                per_device.append(torch.autograd.grad(losses[-1], train, allow_unused=True) if train else ())
                marks["micro"].append((start, len(recorder), m))
            origins.mark(len(recorder), None)  # the backward passes end here
            grads = averaged_gradients(per_device, marks["reduce"], recorder.__len__)
            loss, stacked = mean_loss(losses)
            per_micro = [stacked]
        elif steps == 1:
            loss = micro_loss(batch_fakes)
            grads = torch.autograd.grad(loss, train, allow_unused=True) if train else ()
        else:
            losses, grads = accumulate(micro_loss, train, split(batch_fakes, steps))
            loss, stacked = loss_outputs(losses)
            per_micro = [stacked]
        if devices == 1:
            origins.mark(len(recorder), None)  # the backward passes end here
        if max_grad_norm is not None:
            grads = clipped_gradients(grads, max_grad_norm, norm_type)  # the accumulated gradients, as eager clips
        marks["has_grad"] = [g is not None for g in grads]
        return [loss, *per_micro] + [g for g in grads if g is not None]

    try:
        # library checks of batch-independent values, and the layouts of ops whose meta kernel is not
        # their kernels', answered as eager answers them
        with eager_answers(recorder), _kernel_layouts():
            for fake in (*fake_train, *fake_frozen, *fake_buffers, *fake_leaves):
                recorder.add_input(fake)
            with fake_mode, recording(recorder):
                traced_outputs = step(fake_train, fake_frozen, fake_buffers, fake_leaves)
            traced_outputs = [seen(t, recorder.storages) if isinstance(t, torch.Tensor) else t for t in traced_outputs]
    except DATA_DEPENDENT as err:
        raise data_dependent_refusal(err, origins) from err
    except NotAten as err:
        raise not_aten_refusal(err, origins) from err
    except KernelRefusal as err:
        raise kernel_refusal(err, origins) from err

    tg = TaskGraph(device=device.type)
    tg.optimizer = spec
    tg.batch_spec = flatten_batch_structure(example_batch)[1]
    tg.batch_constants = {i: leaves[j] for i, j in enumerate(order) if not isinstance(leaves[j], torch.Tensor)}
    leaf_names = batch_leaf_names(tg.batch_spec)
    tg.accumulation_steps = steps
    reader = _GraphReader(tg, modules, origins, marks["forward"])
    placeholders = [n for n in recorder.nodes if n.kind == "input"]
    groups = [("param", trainable, ValueKind.PARAMETER), ("param", frozen, ValueKind.FROZEN),
              ("buffer", buffers, ValueKind.FROZEN)]
    inputs = []
    for prefix, tensors, kind in groups:
        for name, tensor in tensors.items():
            inputs.append((f"{prefix}:{name}", kind, tensor))
    for micro in range(micros):
        for i, j in enumerate(order):
            if isinstance(leaves[j], torch.Tensor):
                inputs.append((f"batch:{micro_prefix(micro, micros)}{leaf_names[i]}", ValueKind.BATCH, leaves[j]))
    if len(inputs) != len(placeholders):
        raise RuntimeError(f"traced {len(placeholders)} inputs, expected {len(inputs)}")
    input_vid = {}
    for node, (name, kind, tensor) in zip(placeholders, inputs):
        val = node.returns[0]
        vid = tg.add_value(val.shape, val.stride, val.dtype, val.nbytes, kind, name=name)
        reader.bind_input(val, vid)
        input_vid[name] = vid
        if kind is ValueKind.BATCH:
            tg.batch_inputs.append(vid)
        else:
            tg.initial_state[vid] = tensor.detach()
    by_identity = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        by_identity.setdefault(id(tensor), []).append(key)
    for prefix, tensors, _ in groups:
        for name, tensor in tensors.items():
            for key in by_identity.get(id(tensor), []):
                tg.state_names[key] = input_vid[f"{prefix}:{name}"]

    constants = 0
    for index, node in enumerate(recorder.nodes):
        if node.kind == "op":
            reader.read(node, index)
        elif node.kind == "constant":
            val = node.returns[0]
            # named as make_fx named a lifted constant: a step traces to the TaskGraph (and plan cache key) it did
            vid = tg.add_value(val.shape, val.stride, val.dtype, val.nbytes, ValueKind.CONSTANT,
                               name=f"constant:_tensor_constant{constants}")
            constants += 1
            tg.initial_state[vid] = node.value.detach()
            reader.bind_input(val, vid)
    reader.bind_module_state()
    if not backward:
        for name, out in zip(marks["outputs"], traced_outputs, strict=True):
            tg.outputs[name] = reader.dense_value(reader.template(out), phase="forward")
        log.info("traced %d vertices, %d values (forward only)", len(tg.vertices), len(tg.values))
        return TracedStep(tg, step_passes(donate=donate))
    loss_node, *grad_nodes = traced_outputs
    tg.outputs["loss"] = reader.dense_value(reader.template(loss_node))
    if micros > 1:
        losses_node, *grad_nodes = grad_nodes
        tg.outputs["losses"] = reader.dense_value(reader.template(losses_node))
    grad_iter = iter(grad_nodes)
    grads = {name: (reader.template(next(grad_iter)) if has else None)
             for name, has in zip(trainable, marks["has_grad"])}
    if spec is None:
        for name, ref in grads.items():
            if ref is not None:
                tg.outputs[f"grad:{name}"] = reader.dense_value(ref)
    else:
        append_optimizer(tg, spec, optimizer, trainable, grads, group_of, input_vid,
                          fused=device.type == "cuda" if fused_optimizer is None else fused_optimizer)
    placement = None
    if devices > 1:
        def spanned(spans):
            return {vid: tag for vid, node in reader.vertex_nodes.items()
                    for start, end, tag in spans if start <= node < end}
        placement = (devices, spanned(marks["micro"]), spanned(marks["reduce"]),
                     [input_vid[f"param:{name}"] for name in trainable])
    log.info("traced %d vertices, %d values", len(tg.vertices), len(tg.values))
    return TracedStep(tg, step_passes(loss_blocks=loss_blocks, donate=donate), placement)


def _check_loss(loss, loss_fn) -> None:
    """loss_fn's result is the loss the step differentiates: a floating-point scalar tensor."""
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point():
        return
    code = getattr(loss_fn, "__code__", None)
    fn = f" (loss_fn {getattr(loss_fn, '__qualname__', '')} of {code.co_filename}:{code.co_firstlineno})" \
        if code is not None else ""
    if not isinstance(loss, torch.Tensor):
        raise UnsupportedFeature(f"loss_fn returned a {type(loss).__name__}: it must return a floating-point scalar "
                                 f"tensor, the loss to differentiate{fn}")
    hint = "" if loss.is_floating_point() else "; an integer tensor has no gradient"
    if loss.dim() != 0:
        hint += "; reduce it to one number (.mean() or .sum())"
    raise UnsupportedFeature(f"loss_fn returned a tensor of dtype {loss.dtype}, shape {tuple(loss.shape)}: it must "
                             f"return a floating-point scalar{hint}{fn}")


def check_clipping(max_grad_norm) -> None:
    """max_grad_norm is None (no clipping) or a positive finite number: torch's clip_grad_norm_
    takes any float, but a negative norm flips every gradient, 0 zeroes them and inf clips nothing."""
    if max_grad_norm is None:
        return
    number = isinstance(max_grad_norm, numbers.Real) and not isinstance(max_grad_norm, bool)
    if number and math.isfinite(max_grad_norm) and max_grad_norm > 0:
        return
    effect = ""
    if number and max_grad_norm < 0:
        effect = " (a negative norm would flip the sign of every gradient)"
    elif number and max_grad_norm == 0:
        effect = " (0 would zero every gradient)"
    elif number and math.isinf(max_grad_norm):
        effect = " (an infinite norm clips nothing: pass None)"
    raise ValueError(f"max_grad_norm={max_grad_norm!r}: it must be a positive finite number, the total gradient norm "
                     f"to clip to as torch.nn.utils.clip_grad_norm_'s max_norm, or None for no clipping{effect}")


def _check_forward_only(optimizer, max_grad_norm, steps: int) -> None:
    given = [what for what, on in (("optimizer", optimizer is not None), ("max_grad_norm", max_grad_norm is not None),
                                   ("accumulation_steps > 1", steps > 1)) if on]
    if given:
        raise UnsupportedFeature(f"backward=False traces the forward alone, with no gradients and no update: "
                                 f"it takes no {', '.join(given)}")


def forward_outputs(result) -> list[tuple[str, torch.Tensor]]:
    """The named outputs of a forward-only step (trace's backward=False) from what fn returned."""
    if isinstance(result, torch.Tensor):
        named = [("output", result)]
    elif isinstance(result, (tuple, list)):
        named = [(f"output:{i}", t) for i, t in enumerate(result)]
    elif isinstance(result, dict):
        named = [(f"output:{k}", t) for k, t in result.items()]
        if any(not isinstance(k, str) for k in result):
            raise UnsupportedFeature("a forward-only fn returning a dict must key it by strings")
    else:
        raise UnsupportedFeature(f"a forward-only fn must return a tensor, a tuple or list of tensors or a dict "
                                 f"of str -> tensor, not {type(result).__name__}")
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise UnsupportedFeature(f"forward-only output {name!r} is a {type(t).__name__}, not a tensor "
                                     f"(return tensors only: a KV cache as a tuple of its key and value tensors)")
    if not named:
        raise UnsupportedFeature("a forward-only fn returned no tensors: return the outputs to keep")
    return named
