"""The optimizer update as functional TaskGraph vertices, numerically identical to torch.optim.

Each kind of ir/optimizer.py (SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, NAdam, RAdam, RMSprop,
ASGD) is written as the ATen calls of torch.optim's single-tensor implementation
(`_single_tensor_<name>`), op for op, in the same order and with the same kernels, rather than
traced from it: torch computes its per-step quantities (bias corrections, RAdam's rectification,
NAdam's momentum products, ASGD's step size) in Python floats and branches on them, which a trace
would freeze at the first step's values. Here they and the hyperparameters are `ScalarRef`s,
resolved on the host each step by `OptimizerSpec.scalars` from the step count and the optimizer's
current hyperparameters (an LR scheduler's lr), computed as torch computes them; where torch
branches on one (RAdam's rectification, ASGD's averaging), both sides are computed and the step's
host flag selects one. So the kernels see the numbers eager PyTorch passes them, bit for bit.
"""

from __future__ import annotations

import torch

from ..ir.optimizer import (  # OptimizerSpec re-exported: saved in ir
    CARRIED,
    FUSED_REFUSED,
    HOST_STATES,
    OPTIONS,
    REFUSED_CLASSES,
    REFUSED_OPTIONS,
    TORCH_CLASSES,
    OptimizerSpec,
    state_value_name,
    torch_kind,
)
from ..ir.taskgraph import ScalarRef, TaskGraph, TensorRef, ValueKind
from ..kernels.ops import op_name
from .errors import UnsupportedFeature

aten = torch.ops.aten

_NAMES = [cls.__name__ for cls in TORCH_CLASSES.values()]
SUPPORTED = ", ".join(_NAMES[:-1]) + " and " + _NAMES[-1]  # "SGD, Adam, AdamW, ... and ASGD"


def spec_from_optimizer(optimizer: torch.optim.Optimizer) -> OptimizerSpec:
    """Read kind and hyperparameters, refusing what the functional update does not reproduce."""
    cls = type(optimizer)
    kind = torch_kind(optimizer)  # an Adam with decoupled weight decay runs AdamW's update
    if kind is None:
        why = REFUSED_CLASSES.get(cls.__name__)
        if why is not None:
            raise UnsupportedFeature(f"optimizer {cls.__name__} is not supported: {why}. Supported: {SUPPORTED}")
        raise UnsupportedFeature(f"optimizer {cls.__name__} is not supported (supported: {SUPPORTED})")
    groups = []
    steps = set()
    host = HOST_STATES.get(kind, ())
    carried: list[set] = []
    for i, group in enumerate(optimizer.param_groups):
        for option, why in REFUSED_OPTIONS.items():  # each supported only off
            if group.get(option):
                raise UnsupportedFeature(f"{cls.__name__} option {option}={group[option]} (param group {i}) "
                                         f"is not supported: {why}")
        if kind in FUSED_REFUSED and group.get("fused"):
            raise UnsupportedFeature(f"{cls.__name__} option fused=True (param group {i}) is not supported: torch's "
                                     f"fused {cls.__name__} kernel rounds differently from the single-tensor update "
                                     f"the compiled step runs; make the optimizer with fused=None")
        hp = {}
        for key in OPTIONS[kind]:
            if key in group:
                val = group[key]
                if isinstance(val, torch.Tensor) or (key == "betas" and any(isinstance(b, torch.Tensor) for b in val)):
                    raise UnsupportedFeature(f"{cls.__name__} option {key} given as a tensor (param group {i}): "
                                             "pass a Python float")
                hp[key] = tuple(float(b) for b in val) if key == "betas" else val
        groups.append(hp)
        seen = set()
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if "step" in state:
                steps.add(int(state["step"]))
            elif kind == "sgd" and state.get("momentum_buffer") is not None:
                steps.add(1)  # SGD keeps no step count: any buffer means "not the first step"
            else:
                steps.add(0)
            if host and "step" in state:
                seen.add(tuple((key, float(state[key])) for key in host))
        carried.append(seen)
    if len(steps) > 1:
        raise UnsupportedFeature(f"{cls.__name__} parameters have taken different numbers of steps {sorted(steps)}")
    initial_step = steps.pop() if steps else 0
    for i, (hp, seen) in enumerate(zip(groups, carried)):
        if len(seen) > 1:
            raise UnsupportedFeature(f"{cls.__name__} parameters of param group {i} hold different "
                                     f"{'/'.join(host)} states {sorted(seen)}: the compiled step keeps one per group")
        if host:
            hp[CARRIED] = {initial_step: dict(seen.pop()) if seen else {}}
    return OptimizerSpec(kind, groups, initial_step)


def _filled(param: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    """A fresh state of ``param``'s shape and dtype holding ``value`` everywhere, as one element
    broadcast: it takes no memory until the runtime copies it into its home (AdamW's two states of
    gpt1.3b, made with zeros_like, were 10.4 GB of host memory filled during every compile)."""
    return torch.full((), value, dtype=param.dtype, device=param.device).expand(param.shape)


def _zeros(param: torch.Tensor) -> torch.Tensor:
    return _filled(param, 0.0)


def initial_states(spec: OptimizerSpec, optimizer: torch.optim.Optimizer, param: torch.Tensor
                   ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per state a parameter's update keeps in a home: (its initial tensor, a tensor of the layout its
    value takes). The initial tensor is its current torch state where it has one (its own layout),
    else as torch's first step makes it (SGD's momentum buffer: see `_sgd`), broadcast from one
    element (_filled), with the layout torch's ``*_like(param)`` gives it, on the meta device. The step
    count and HOST_STATES are kept on the host (OptimizerSpec)."""
    state = optimizer.state.get(param, {})
    hp = next(spec.groups[g] for g, group in enumerate(optimizer.param_groups)
              if any(p is param for p in group["params"]))
    kind = spec.kind
    fresh: dict = {}
    if kind == "sgd":
        if hp["momentum"] == 0:
            return {}
        fresh["momentum_buffer"] = lambda: _filled(param, -0.0)
    elif kind in ("adam", "adamw", "nadam", "radam"):
        fresh["exp_avg"] = fresh["exp_avg_sq"] = lambda: _zeros(param)
        if hp.get("amsgrad"):
            fresh["max_exp_avg_sq"] = lambda: _zeros(param)
    elif kind == "adagrad":
        fresh["sum"] = lambda: _filled(param, hp["initial_accumulator_value"])
    elif kind == "adadelta":
        fresh["square_avg"] = fresh["acc_delta"] = lambda: _zeros(param)
    elif kind == "adamax":
        fresh["exp_avg"] = fresh["exp_inf"] = lambda: _zeros(param)
    elif kind == "rmsprop":
        fresh["square_avg"] = lambda: _zeros(param)
        if hp["momentum"] > 0:
            fresh["momentum_buffer"] = lambda: _zeros(param)
        if hp["centered"]:
            fresh["grad_avg"] = lambda: _zeros(param)
    elif kind == "asgd":
        fresh["ax"] = lambda: _zeros(param)
    out = {}
    for key, make in fresh.items():
        tensor = state.get(key)
        if tensor is not None:
            out[key] = (tensor.detach(), tensor)
        else:
            out[key] = (make().detach(), torch.empty_like(param, memory_format=torch.preserve_format, device="meta"))
    return out


class _Scalars:
    """``s.lr`` is ScalarRef("g<group>.lr"): the host scalars of one param group's update."""

    def __init__(self, group: int):
        self._group = group

    def __getattr__(self, name: str) -> ScalarRef:
        if name.startswith("_"):
            raise AttributeError(name)
        return ScalarRef(f"g{self._group}.{name}")


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
        as in eager, with the kernel of eager's in-place call on its temporary (sqrt for sqrt_)."""
        hp = self.spec.groups[group]
        if hp.get("maximize"):
            grad = self.emit(aten.neg.default, grad)
        step = getattr(self, f"_{'adam' if self.spec.kind == 'adamw' else self.spec.kind}")
        return step(hp, _Scalars(group), param, grad, dict(states))

    def _coupled_decay(self, hp: dict, s, param: TensorRef, grad: TensorRef) -> TensorRef:
        """grad.add(param, alpha=weight_decay), where weight decay is on."""
        return self.emit(aten.add.Tensor, grad, param, alpha=s.weight_decay) if hp["weight_decay"] != 0 else grad

    def _weight_decay(self, hp: dict, s, param: TensorRef, grad: TensorRef, decoupled: bool):
        """(param, grad) after weight decay: param.mul_(1 - lr * weight_decay) when decoupled, else
        the gradient's."""
        if hp["weight_decay"] != 0 and decoupled:
            return self.emit_in_place(aten.mul_.Tensor, param, s.decay_factor), grad
        return param, self._coupled_decay(hp, s, param, grad)

    def _moments(self, s, states: dict, grad: TensorRef) -> None:
        """exp_avg.lerp_(grad, 1 - beta1); exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)."""
        states["exp_avg"] = self.emit_in_place(aten.lerp_.Scalar, states["exp_avg"], grad, s.one_minus_beta1)
        sq = self.emit_in_place(aten.mul_.Tensor, states["exp_avg_sq"], s.beta2)
        states["exp_avg_sq"] = self.emit_in_place(aten.addcmul_.default, sq, grad, grad, value=s.one_minus_beta2)

    def _select(self, flag: ScalarRef, if_set: TensorRef, otherwise: TensorRef) -> TensorRef:
        """torch.where on a host flag of the step: the branch torch's Python takes, both computed."""
        cond = self.emit(aten.scalar_tensor.default, flag, dtype=torch.bool, device=torch.device(self.tg.device))
        return self.emit(aten.where.self, cond, if_set, otherwise)

    def _sgd(self, hp, s, param, grad, states):
        grad = self._coupled_decay(hp, s, param, grad)
        if hp["momentum"] != 0:
            buf = self.emit_in_place(aten.mul_.Tensor, states["momentum_buffer"], s.buf_scale)
            buf = states["momentum_buffer"] = self.emit_in_place(aten.add_.Tensor, buf, grad, alpha=s.grad_scale)
            grad = self.emit(aten.add.Tensor, grad, buf, alpha=s.momentum) if hp.get("nesterov") else buf
        return self.emit_in_place(aten.add_.Tensor, param, grad, alpha=s.neg_lr), states

    def _adam(self, hp, s, param, grad, states):
        param, grad = self._weight_decay(hp, s, param, grad, decoupled=self.spec.kind == "adamw")
        self._moments(s, states, grad)
        sq = states["exp_avg_sq"]
        if hp.get("amsgrad"):  # torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
            sq = states["max_exp_avg_sq"] = self.emit(aten.maximum.default, states["max_exp_avg_sq"], sq)
        denom = self.emit(aten.sqrt.default, sq)
        denom = self.emit(aten.div.Tensor, denom, s.bias_correction2_sqrt)
        denom = self.emit(aten.add.Tensor, denom, s.eps)
        return self.emit_in_place(aten.addcdiv_.default, param, states["exp_avg"], denom, value=s.neg_step_size), states

    def _adagrad(self, hp, s, param, grad, states):
        grad = self._coupled_decay(hp, s, param, grad)
        total = states["sum"] = self.emit_in_place(aten.addcmul_.default, states["sum"], grad, grad, value=1)
        std = self.emit(aten.add.Tensor, self.emit(aten.sqrt.default, total), s.eps)
        return self.emit_in_place(aten.addcdiv_.default, param, grad, std, value=s.neg_clr), states

    def _adadelta(self, hp, s, param, grad, states):
        grad = self._coupled_decay(hp, s, param, grad)
        square_avg = self.emit_in_place(aten.mul_.Tensor, states["square_avg"], s.rho)
        square_avg = states["square_avg"] = self.emit_in_place(aten.addcmul_.default, square_avg, grad, grad,
                                                               value=s.one_minus_rho)
        std = self.emit(aten.sqrt.default, self.emit(aten.add.Tensor, square_avg, s.eps))
        delta = self.emit(aten.sqrt.default, self.emit(aten.add.Tensor, states["acc_delta"], s.eps))
        delta = self.emit(aten.mul.Tensor, self.emit(aten.div.Tensor, delta, std), grad)
        acc_delta = self.emit_in_place(aten.mul_.Tensor, states["acc_delta"], s.rho)
        states["acc_delta"] = self.emit_in_place(aten.addcmul_.default, acc_delta, delta, delta, value=s.one_minus_rho)
        return self.emit_in_place(aten.add_.Tensor, param, delta, alpha=s.neg_lr), states

    def _adamax(self, hp, s, param, grad, states):
        grad = self._coupled_decay(hp, s, param, grad)
        states["exp_avg"] = self.emit_in_place(aten.lerp_.Scalar, states["exp_avg"], grad, s.one_minus_beta1)
        # torch.maximum(exp_inf.mul_(beta2), grad.abs().add_(eps), out=exp_inf)
        exp_inf = self.emit_in_place(aten.mul_.Tensor, states["exp_inf"], s.beta2)
        bound = self.emit(aten.add.Tensor, self.emit(aten.abs.default, grad), s.eps)
        exp_inf = states["exp_inf"] = self.emit(aten.maximum.default, exp_inf, bound)
        return self.emit_in_place(aten.addcdiv_.default, param, states["exp_avg"], exp_inf, value=s.neg_clr), states

    def _nadam(self, hp, s, param, grad, states):
        param, grad = self._weight_decay(hp, s, param, grad, decoupled=hp.get("decoupled_weight_decay", False))
        self._moments(s, states, grad)
        denom = self.emit(aten.sqrt.default, self.emit(aten.div.Tensor, states["exp_avg_sq"], s.bias_correction2))
        denom = self.emit(aten.add.Tensor, denom, s.eps)
        param = self.emit_in_place(aten.addcdiv_.default, param, grad, denom, value=s.grad_value)
        return self.emit_in_place(aten.addcdiv_.default, param, states["exp_avg"], denom, value=s.avg_value), states

    def _radam(self, hp, s, param, grad, states):
        param, grad = self._weight_decay(hp, s, param, grad, decoupled=hp.get("decoupled_weight_decay", False))
        self._moments(s, states, grad)
        step = self.emit(aten.mul.Tensor, self.emit(aten.div.Tensor, states["exp_avg"], s.bias_correction1), s.lr)
        # rectified: step * ((bias_correction2 ** 0.5) / exp_avg_sq.sqrt().add_(eps)) * rect, the division
        # of a float by a tensor being reciprocal() * float (Tensor.__rtruediv__)
        adaptive = self.emit(aten.add.Tensor, self.emit(aten.sqrt.default, states["exp_avg_sq"]), s.eps)
        adaptive = self.emit(aten.mul.Tensor, self.emit(aten.reciprocal.default, adaptive), s.bias_correction2_sqrt)
        rectified = self.emit(aten.mul.Tensor, self.emit(aten.mul.Tensor, step, adaptive), s.rect)
        step = self._select(s.rectify, rectified, step)  # torch: if rho_t > 5.0
        return self.emit_in_place(aten.add_.Tensor, param, step, alpha=-1.0), states

    def _rmsprop(self, hp, s, param, grad, states):
        grad = self._coupled_decay(hp, s, param, grad)
        square_avg = self.emit_in_place(aten.mul_.Tensor, states["square_avg"], s.alpha)
        square_avg = states["square_avg"] = self.emit_in_place(aten.addcmul_.default, square_avg, grad, grad,
                                                               value=s.one_minus_alpha)
        if hp["centered"]:
            grad_avg = states["grad_avg"] = self.emit_in_place(aten.lerp_.Scalar, states["grad_avg"], grad,
                                                               s.one_minus_alpha)
            avg = self.emit(aten.sqrt.default, self.emit(aten.addcmul.default, square_avg, grad_avg, grad_avg, value=-1))
        else:
            avg = self.emit(aten.sqrt.default, square_avg)
        avg = self.emit(aten.add.Tensor, avg, s.eps)
        if hp["momentum"] > 0:
            buf = self.emit_in_place(aten.mul_.Tensor, states["momentum_buffer"], s.momentum)
            buf = states["momentum_buffer"] = self.emit_in_place(aten.addcdiv_.default, buf, grad, avg)
            return self.emit_in_place(aten.add_.Tensor, param, buf, alpha=s.neg_lr), states
        return self.emit_in_place(aten.addcdiv_.default, param, grad, avg, value=s.neg_lr), states

    def _asgd(self, hp, s, param, grad, states):
        grad = self._coupled_decay(hp, s, param, grad)
        param = self.emit_in_place(aten.mul_.Tensor, param, s.decay)  # param.mul_(1 - lambd * eta)
        param = self.emit_in_place(aten.add_.Tensor, param, grad, alpha=s.neg_eta)
        # if mu != 1: ax.add_(param.sub(ax).mul_(mu)), else ax.copy_(param)
        ax = states["ax"]
        averaged = self.emit(aten.add.Tensor, ax, self.emit(aten.mul.Tensor, self.emit(aten.sub.Tensor, param, ax), s.mu))
        states["ax"] = self._select(s.copy_ax, param, averaged)
        return param, states

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
    # torch's fused Adam kernel, as it is here, runs neither amsgrad nor maximize: those take the single-tensor update
    fused = fused and spec.kind in ("adam", "adamw") and not any(g.get("amsgrad") or g.get("maximize")
                                                                 for g in spec.groups)
    step = _step_counter(tg, spec) if fused and any(g is not None for g in grads.values()) else None
    fused_members: list[tuple] = []  # (name, param, param group, value id, grad, state refs) for the fused kernel
    for name, param in trainable.items():
        grad = grads[name]
        if grad is None:
            continue  # eager leaves .grad None and skips the parameter
        emitter = UpdateEmitter(tg, spec, module=name.rpartition(".")[0])
        pvid = input_vid[f"param:{name}"]
        state_refs = {}
        for key, (tensor, layout) in initial_states(spec, optimizer, param).items():
            svid = tg.add_value(layout.shape, layout.stride(), layout.dtype, layout.untyped_storage().nbytes(),
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
