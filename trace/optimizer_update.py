"""The optimizer update as functional TaskGraph vertices, numerically identical to torch.optim.

Hyperparameters are read from the user's torch optimizer. Quantities that
change from step to step (Adam's bias corrections, SGD's first-step momentum
rule) and the hyperparameters themselves are `ScalarRef`s resolved on the host
each step by `OptimizerSpec.scalars`, computed in Python floats exactly as
torch.optim's single-tensor implementation does, so the kernels see the same
scalars eager PyTorch passes them.
"""

from __future__ import annotations

import torch

from ..ir.optimizer import (  # OptimizerSpec re-exported: saved in ir
    REFUSED_OPTIONS,
    OptimizerSpec,
    state_value_name,
    torch_kind,
)
from ..ir.taskgraph import ScalarRef, TaskGraph, TensorRef, ValueKind
from ..kernels.ops import op_name
from .errors import UnsupportedFeature

aten = torch.ops.aten

def spec_from_optimizer(optimizer: torch.optim.Optimizer) -> OptimizerSpec:
    """Read kind and hyperparameters, refusing what the functional update does not reproduce."""
    cls = type(optimizer)
    kind = torch_kind(optimizer)  # an Adam with decoupled weight decay runs AdamW's update
    if kind is None:
        raise UnsupportedFeature(f"optimizer {cls.__name__} is not supported (supported: SGD, Adam, AdamW)")
    groups = []
    steps = set()
    for i, group in enumerate(optimizer.param_groups):
        for option in REFUSED_OPTIONS:  # each supported only off
            if group.get(option):
                raise UnsupportedFeature(f"{cls.__name__} option {option}={group[option]} (param group {i}) "
                                         f"is not supported")
        hp = {}
        for key in ("lr", "weight_decay", "momentum", "dampening", "nesterov", "betas", "eps"):
            if key in group:
                val = group[key]
                if isinstance(val, torch.Tensor) or (key == "betas" and any(isinstance(b, torch.Tensor) for b in val)):
                    raise UnsupportedFeature(f"{cls.__name__} option {key} given as a tensor (param group {i}): "
                                             "pass a Python float")
                hp[key] = tuple(float(b) for b in val) if key == "betas" else val
        groups.append(hp)
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if "step" in state:
                steps.add(int(state["step"]))
            elif kind == "sgd" and state.get("momentum_buffer") is not None:
                steps.add(1)  # SGD keeps no step count: any buffer means "not the first step"
            else:
                steps.add(0)
    if len(steps) > 1:
        raise UnsupportedFeature(f"{cls.__name__} parameters have taken different numbers of steps {sorted(steps)}")
    return OptimizerSpec(kind, groups, steps.pop() if steps else 0)


def initial_states(spec: OptimizerSpec, optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """The optimizer state tensors a parameter starts with (its current torch state, or eager's init)."""
    state = optimizer.state.get(param, {})
    if spec.kind == "sgd":
        momentum = next(g["momentum"] for g in optimizer.param_groups if any(p is param for p in g["params"]))
        if momentum == 0:
            return {}
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = torch.full_like(param, -0.0, memory_format=torch.preserve_format)
        return {"momentum_buffer": buf.detach()}
    if "exp_avg" in state:
        return {"exp_avg": state["exp_avg"].detach(), "exp_avg_sq": state["exp_avg_sq"].detach()}
    zeros = torch.zeros_like(param, memory_format=torch.preserve_format).detach()
    return {"exp_avg": zeros, "exp_avg_sq": zeros.clone()}


class UpdateEmitter:
    """Appends the update of one parameter to a TaskGraph, inferring output layouts on the meta device."""

    def __init__(self, tg: TaskGraph, spec: OptimizerSpec, module: str = ""):
        self.tg, self.spec, self.module = tg, spec, module

    def _meta(self, template):
        if isinstance(template, TensorRef):
            val = self.tg.values[template.value]
            return torch.empty_strided(template.size, template.stride, dtype=val.dtype, device="meta")
        if isinstance(template, ScalarRef):
            return 0.5
        if isinstance(template, (list, tuple)):
            return type(template)(self._meta(t) for t in template)
        if isinstance(template, dict):
            return {k: self._meta(t) for k, t in template.items()}
        return template

    def emit(self, op, *args, **kwargs) -> TensorRef:
        out = op(*self._meta(args), **self._meta(kwargs))
        nbytes = out.untyped_storage().nbytes()
        vid = self.tg.add_value(out.shape, out.stride(), out.dtype, nbytes)
        self.tg.add_vertex(op_name(op), args, kwargs, (vid,), module=self.module, phase="optimizer")
        return self.tg.values[vid].dense_ref

    def emit_in_place(self, op, target: TensorRef, *args, **kwargs) -> TensorRef:
        """`target.op_(*args)` as eager's single-tensor optimizer writes it: a new version of target
        (copy_in), which the builder places over the old one when nothing reads the old one after."""
        val = self.tg.values[target.value]
        if target != val.dense_ref:
            raise ValueError(f"in-place optimizer update of a view of value {target.value}")
        new = self.tg.add_value(val.shape, val.stride, val.dtype, val.nbytes)
        ref = self.tg.values[new].dense_ref
        self.tg.add_vertex(op_name(op), (ref, *args), kwargs, (new,), module=self.module, phase="optimizer",
                           copy_in=((target.value, new),))
        return ref

    def fused_update(self, group: int, params: list[TensorRef], grads: list[TensorRef],
                     states: list[dict[str, TensorRef]], step: TensorRef) -> list[tuple[TensorRef, dict]]:
        """Adam/AdamW for several parameters as one multi-tensor fused kernel (the kernel of
        torch.optim.AdamW(fused=True)), updating each parameter and its states in place: a few
        passes over memory and one launch instead of a dozen per parameter. Returns
        (new param, new states) per parameter."""
        def s(name: str) -> ScalarRef:
            return ScalarRef(f"g{group}.{name}")

        tg = self.tg
        olds, news, fixed_grads = [], [], []
        for param, grad, st in zip(params, grads, states, strict=True):
            home = tg.values[param.value]
            if grad != TensorRef(grad.value, home.shape, home.stride, 0) or tg.values[grad.value].stride != home.stride:
                # the fused kernel walks all its tensors with one layout: give the gradient the parameter's
                grad = self.emit(aten.clone.default, grad, memory_format=torch.contiguous_format)
            fixed_grads.append(grad)
            for old in (param, st["exp_avg"], st["exp_avg_sq"]):
                val = tg.values[old.value]
                olds.append(old)
                news.append(tg.add_value(val.shape, val.stride, val.dtype, val.nbytes))
        refs = [tg.values[v].dense_ref for v in news]
        op = aten._fused_adamw_.default if self.spec.kind == "adamw" else aten._fused_adam_.default
        tg.add_vertex(op_name(op), (refs[0::3], fixed_grads, refs[1::3], refs[2::3], [], [step] * len(params)),
                      {"lr": s("lr"), "beta1": s("beta1"), "beta2": s("beta2"),
                       "weight_decay": s("weight_decay"), "eps": s("eps"), "amsgrad": False,
                       "maximize": False, "grad_scale": None, "found_inf": None},
                      tuple(news), module=self.module, phase="optimizer",
                      copy_in=tuple((old.value, new) for old, new in zip(olds, news)))
        return [(refs[k], {"exp_avg": refs[k + 1], "exp_avg_sq": refs[k + 2]}) for k in range(0, len(refs), 3)]

    def update(self, group: int, param: TensorRef, grad: TensorRef, states: dict[str, TensorRef]) -> tuple[TensorRef, dict]:
        """Returns (new param, new states) as refs to freshly produced values. Where eager's
        single-tensor step updates a tensor in place (param.addcdiv_, exp_avg.lerp_, ...), so does
        this, with the same kernel; the rest (weight-decayed gradient, denominator) is out of place
        as in eager."""
        def s(name: str) -> ScalarRef:
            return ScalarRef(f"g{group}.{name}")

        hp = self.spec.groups[group]
        if self.spec.kind == "sgd":
            if hp["weight_decay"] != 0:
                grad = self.emit(aten.add.Tensor, grad, param, alpha=s("weight_decay"))
            new_states = {}
            if hp["momentum"] != 0:
                buf = self.emit_in_place(aten.mul_.Tensor, states["momentum_buffer"], s("buf_scale"))
                buf = self.emit_in_place(aten.add_.Tensor, buf, grad, alpha=s("grad_scale"))
                new_states["momentum_buffer"] = buf
                grad = self.emit(aten.add.Tensor, grad, buf, alpha=s("momentum")) if hp.get("nesterov") else buf
            return self.emit_in_place(aten.add_.Tensor, param, grad, alpha=s("neg_lr")), new_states
        decoupled = self.spec.kind == "adamw"
        if hp["weight_decay"] != 0:
            if decoupled:
                param = self.emit_in_place(aten.mul_.Tensor, param, s("decay_factor"))
            else:
                grad = self.emit(aten.add.Tensor, grad, param, alpha=s("weight_decay"))
        exp_avg = self.emit_in_place(aten.lerp_.Scalar, states["exp_avg"], grad, s("one_minus_beta1"))
        exp_avg_sq = self.emit_in_place(aten.mul_.Tensor, states["exp_avg_sq"], s("beta2"))
        exp_avg_sq = self.emit_in_place(aten.addcmul_.default, exp_avg_sq, grad, grad, value=s("one_minus_beta2"))
        denom = self.emit(aten.sqrt.default, exp_avg_sq)
        denom = self.emit(aten.div.Tensor, denom, s("bias_correction2_sqrt"))
        denom = self.emit(aten.add.Tensor, denom, s("eps"))
        new_param = self.emit_in_place(aten.addcdiv_.default, param, exp_avg, denom, value=s("neg_step_size"))
        return new_param, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}

    def into_layout_of(self, new: TensorRef, home_value: int) -> int:
        """The value id holding `new` with the layout of `home_value` (copied if the layouts differ)."""
        home = self.tg.values[home_value]
        produced = self.tg.values[new.value]
        if produced.stride == home.stride and produced.nbytes == home.nbytes and new == produced.dense_ref:
            return new.value
        fresh = self.emit(aten.empty_strided.default, list(home.shape), list(home.stride), dtype=home.dtype,
                          device=torch.device(self.tg.device))
        target = self.tg.add_value(home.shape, home.stride, home.dtype, home.nbytes)
        self.tg.add_vertex(op_name(aten.copy_.default), (TensorRef(target, home.shape, home.stride, 0), new), {},
                           (target,), module=self.module, phase="optimizer", copy_in=((fresh.value, target),))
        return target


def _step_counter(tg: TaskGraph, spec) -> TensorRef:
    """The optimizer's step count as a device scalar (fused kernels read it), incremented each step."""
    old = tg.add_value((), (), torch.float32, 4, ValueKind.OPTIMIZER_STATE, name="opt:step")
    tg.initial_state[old] = torch.tensor(float(spec.initial_step), dtype=torch.float32)
    emitter = UpdateEmitter(tg, spec, module="")
    new = emitter.emit_in_place(torch.ops.aten.add_.Tensor, tg.values[old].dense_ref, 1.0)
    tg.bindings[old] = new.value
    return new


def clipped_gradients(grads, max_norm: float, norm_type: float):
    """clip_grad_norm_ on the gradients as values: torch's own total norm, then the scale it applies.
    Per tensor rather than as one _foreach_ op over every gradient, so no step needs all gradients
    in memory at once (small budgets); on the CPU _foreach_ ops run exactly these per-tensor kernels."""
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    total = torch.nn.utils.get_total_norm(present, norm_type, foreach=False)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return tuple(None if g is None else g * coef for g in grads)


FUSED_GROUP_BYTES = 64 << 20  # parameter bytes one multi-tensor update vertex covers at most


def _fused_groups(members: list[tuple]) -> list[list[tuple]]:
    """Consecutive parameters of one block (module path up to its first numeric part, e.g.
    'blocks.3') and one param group: small tensors (norms, biases) share a launch with their
    block's matrices, and a group's update waits only for its block's gradients, so the planner
    can still stream optimizer states block by block. A group holds at most as many parameter
    bytes as the largest single parameter (and FUSED_GROUP_BYTES), so no group's update needs
    more memory at once than the largest parameter's own update: the smallest feasible budget
    does not grow."""
    cap = min(FUSED_GROUP_BYTES, max((m[1].numel() * m[1].element_size() for m in members), default=0))
    def block(name: str) -> str:
        parts = name.split(".")
        for k, part in enumerate(parts[:-1]):
            if part.isdigit():
                return ".".join(parts[:k + 1])
        return parts[0] if len(parts) > 1 else ""

    groups: list[list[tuple]] = []
    key, size = None, 0
    for member in members:
        name, param, group = member[0], member[1], member[2]
        nbytes = param.numel() * param.element_size()
        this = (block(name), group, param.dtype)
        if groups and this == key and size + nbytes <= cap:
            groups[-1].append(member)
            size += nbytes
        else:
            groups.append([member])
            key, size = this, nbytes
    return groups


def append_optimizer(tg, spec, optimizer, trainable, grads, group_of, input_vid, fused: bool) -> None:
    fused = fused and spec.kind in ("adam", "adamw")
    step = _step_counter(tg, spec) if fused and any(g is not None for g in grads.values()) else None
    fused_members: list[tuple] = []  # (name, param, param group, value id, grad, state refs) for the fused kernel
    for name, param in trainable.items():
        grad = grads[name]
        if grad is None:
            continue  # eager leaves .grad None and skips the parameter
        emitter = UpdateEmitter(tg, spec, module=name.rpartition(".")[0])
        pvid = input_vid[f"param:{name}"]
        state_refs = {}
        for key, tensor in initial_states(spec, optimizer, param).items():
            svid = tg.add_value(tensor.shape, tensor.stride(), tensor.dtype, tensor.untyped_storage().nbytes(),
                                ValueKind.OPTIMIZER_STATE, name=state_value_name(name, key))
            tg.initial_state[svid] = tensor
            state_refs[key] = tg.values[svid].dense_ref
        if step is not None and param.is_contiguous():
            fused_members.append((name, param, group_of[id(param)], pvid, grad, state_refs))
            continue
        new_param, new_states = emitter.update(group_of[id(param)], tg.values[pvid].dense_ref, grad, state_refs)
        _bind(tg, emitter, pvid, new_param, state_refs, new_states)
    for members in _fused_groups(fused_members):
        emitter = UpdateEmitter(tg, spec, module=_common_module([m[0] for m in members]))
        results = emitter.fused_update(members[0][2], [tg.values[m[3]].dense_ref for m in members],
                                       [m[4] for m in members], [m[5] for m in members], step=step)
        for (_name, _param, _group, pvid, _grad, state_refs), (new_param, new_states) in zip(members, results):
            _bind(tg, emitter, pvid, new_param, state_refs, new_states)


def _bind(tg: TaskGraph, emitter: UpdateEmitter, pvid: int, new_param: TensorRef, state_refs: dict,
          new_states: dict) -> None:
    """The updated parameter and states replace their inputs at the end of the step."""
    tg.bindings[pvid] = emitter.into_layout_of(new_param, pvid)
    for key, ref in new_states.items():
        tg.bindings[state_refs[key].value] = emitter.into_layout_of(ref, state_refs[key].value)


def _common_module(names: list[str]) -> str:
    """The deepest module holding every parameter named (for messages and traces)."""
    paths = [n.split(".")[:-1] for n in names]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)
