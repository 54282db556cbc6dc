"""The optimizer a compiled step applies: its spec (saved with the graph) and its torch-facing view.

OptimizerSpec is plain data (it is saved with the graph); ``scalars`` turns it
into the host scalars each step's `ScalarRef`s resolve to. Read from a torch
optimizer by ``trace.optimizer_update.spec_from_optimizer``.

CompiledOptimizer is ``mg.optimizer``: a torch.optim.Optimizer over the
MemGraph, whose ``param_groups`` are the torch optimizer's (an LR scheduler
acts on the step) and whose ``state_dict()`` is in torch's format with the
states the step keeps in its homes, so training can move back to eager with
``opt.load_state_dict(mg.optimizer.state_dict())``. ``memgraph.compile`` sets it
over the user's optimizer, ``memgraph.load`` over the saved hyperparameters (or over
the torch optimizer given to it, which takes them: ``OptimizerSpec.restore``).
``mark_stepped`` tells LR schedulers that engine.run applied an update.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from .taskgraph import TensorRef

# The kinds of update a compiled step runs, each torch.optim's single-tensor implementation
# (`_single_tensor_<name>` in torch/optim/<name>.py) op for op: the torch class of each, whose defaults
# fill a loaded step's param groups ("adamw" is also an Adam with decoupled_weight_decay=True).
TORCH_CLASSES = {
    "sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "adagrad": torch.optim.Adagrad,
    "adadelta": torch.optim.Adadelta, "adamax": torch.optim.Adamax, "nadam": torch.optim.NAdam,
    "radam": torch.optim.RAdam, "rmsprop": torch.optim.RMSprop, "asgd": torch.optim.ASGD,
}
# the options of a param group each kind reads: hyperparameters (host scalars) and the switches that
# decide which ops its update runs (nesterov, amsgrad, maximize, centered, decoupled_weight_decay)
OPTIONS = {
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
    "adam": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"),
    "adamw": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"),
    "adagrad": ("lr", "lr_decay", "weight_decay", "eps", "initial_accumulator_value", "maximize"),
    "adadelta": ("lr", "rho", "eps", "weight_decay", "maximize"),
    "adamax": ("lr", "betas", "eps", "weight_decay", "maximize"),
    "nadam": ("lr", "betas", "eps", "weight_decay", "momentum_decay", "decoupled_weight_decay", "maximize"),
    "radam": ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "maximize"),
    "rmsprop": ("lr", "alpha", "eps", "weight_decay", "momentum", "centered", "maximize"),
    "asgd": ("lr", "lambd", "alpha", "t0", "weight_decay", "maximize"),
}
# the states torch.optim keeps per parameter, in its order ("step" and HOST_STATES are host numbers
# here, the rest tensors the step updates in its homes; SGD's buffer only with momentum, amsgrad's
# maximum, RMSprop's buffer and centered average only where the option asks for them)
STATE_KEYS = {
    "sgd": ("momentum_buffer",),
    "adam": ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "adamw": ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "adagrad": ("step", "sum"),
    "adadelta": ("step", "square_avg", "acc_delta"),
    "adamax": ("step", "exp_avg", "exp_inf"),
    "nadam": ("step", "mu_product", "exp_avg", "exp_avg_sq"),
    "radam": ("step", "exp_avg", "exp_avg_sq"),
    "rmsprop": ("step", "square_avg", "momentum_buffer", "grad_avg"),
    "asgd": ("step", "eta", "mu", "ax"),
}
# states torch keeps as one-element tensors that its Python code reads back as floats (NAdam's product
# of momentum factors; ASGD's step size and averaging factor): the step keeps them on the host, per
# param group, in the group's CARRIED entry, rounded to the tensor's dtype exactly as torch rounds them
HOST_STATES = {"nadam": ("mu_product",), "asgd": ("eta", "mu")}
CARRIED = "carried"  # param group key: {step: {host state: value after that step}} (see OptimizerSpec.carried)

# hyperparameters a step reads as host scalars, so an LR scheduler (or a user) may change them between
# steps; a change that alters the traced update itself (a zero becoming non-zero) needs a new compile
SCHEDULABLE = ("lr", "betas", "eps", "momentum", "dampening", "weight_decay", "alpha", "rho", "lr_decay",
               "momentum_decay", "lambd", "t0", "initial_accumulator_value")
STRUCTURAL_ZERO = ("momentum", "weight_decay")  # zero or not decides which ops were traced
# what an LR scheduler keeps in a param group beside the hyperparameters: the lr it scales (torch's
# schedulers need it to resume with last_epoch >= 0). Followed and saved, never read by the step.
SCHEDULER_KEYS = ("initial_lr",)
# options of torch's optimizers the traced update does not run (compile refuses them on, saying why)
REFUSED_OPTIONS = {
    "differentiable": "it makes the update itself differentiable (autograd through optimizer.step()), which a "
                      "compiled step, whose update runs after the backward, does not record",
}
# where torch has its own fused kernel for a kind that runs the single-tensor update here: refused on,
# since that kernel rounds differently (Adam and AdamW run torch's fused kernel with fused_optimizer=True)
FUSED_REFUSED = ("adagrad",)
# torch.optim classes no kind runs, and why (the rest are "not supported")
REFUSED_CLASSES = {
    "LBFGS": "its step() calls a closure that evaluates the loss and gradients again, several times per step "
             "(a line search), while a compiled step runs one forward and one backward before its update",
}


def structural_options(kind: str) -> tuple[str, ...]:
    """The options of `kind` that decide which ops its update runs (followed only unchanged)."""
    return tuple(k for k in OPTIONS.get(kind, ()) if k not in SCHEDULABLE)


@dataclass
class OptimizerSpec:
    kind: str  # a key of TORCH_CLASSES: "sgd" | "adam" | "adamw" | "adagrad" | "nadam" | ...
    # per param group: its OPTIONS (lr, betas, eps, weight_decay, momentum, amsgrad, ...) and, for a kind
    # with HOST_STATES, the CARRIED values
    groups: list[dict] = field(default_factory=list)
    initial_step: int = 0  # steps the torch optimizer had already taken
    # per param group, the model's names of its parameters in the group's order (torch numbers the
    # parameters of a state_dict in this order)
    params: list[list[str]] = field(default_factory=list)

    def state_keys(self) -> tuple[str, ...]:
        """The states torch.optim keeps per parameter for this kind, in its order (SGD: only with
        momentum; the keys that an option turns on are listed whether it is on or not)."""
        return STATE_KEYS[self.kind]

    def follow(self, param_groups: list[dict]) -> None:
        """Take the torch optimizer's current hyperparameters (set by an LR scheduler, say), so the
        next step uses them as eager's would, and the ``initial_lr`` a scheduler keeps in a group (so a
        loaded step's param groups hold it as the saved optimizer's did). Refuses, naming it, a change
        the traced update cannot follow: a different number of groups, a tensor value, a
        hyperparameter becoming zero or non-zero where that decides which ops run, or any other option
        (nesterov, amsgrad, ...); a refused change leaves every group as it was."""
        self.groups = self._followed_groups(param_groups)

    def following(self, param_groups: list[dict]) -> OptimizerSpec:
        """A copy of this spec that has followed ``param_groups`` (this one is left as it is)."""
        groups = self._followed_groups(param_groups)
        for group in groups:
            if CARRIED in group:
                group[CARRIED] = {step: dict(values) for step, values in group[CARRIED].items()}
        return dataclasses.replace(self, groups=groups, params=[list(names) for names in self.params])

    def _followed_groups(self, param_groups: list[dict]) -> list[dict]:
        if len(param_groups) != len(self.groups):
            raise ValueError(f"the optimizer has {len(param_groups)} parameter groups, the compiled step "
                             f"{len(self.groups)}: compile again after adding groups")
        defaults = torch_group_defaults(self.kind)
        groups = []
        for g, (group, hp) in enumerate(zip(param_groups, self.groups)):
            new = dict(hp)
            for key in SCHEDULABLE:
                if key not in hp:
                    continue
                value = group[key]
                values = value if key == "betas" else (value,)
                if not all(_is_number(x) for x in values):
                    raise ValueError(f"param group {g}: {key}={value!r}; the compiled step takes Python numbers")
                new[key] = tuple(float(x) for x in value) if key == "betas" else value
                if key in STRUCTURAL_ZERO and (hp[key] == 0) != (value == 0):
                    raise ValueError(f"param group {g}: {key} changed from {hp[key]} to {value}, which changes "
                                     f"the traced update: compile again")
            for key in SCHEDULER_KEYS:
                if _is_number(group.get(key)):
                    new[key] = group[key]
            followed = {*SCHEDULABLE, *SCHEDULER_KEYS, CARRIED}
            # a switch the spec was saved without (an older file) ran as torch's default
            switches = {**{k: defaults[k] for k in structural_options(self.kind) if k in defaults}, **hp}
            for key, old in switches.items():
                if key not in followed and group.get(key, old) != old:
                    raise ValueError(f"param group {g}: {key} changed from {old!r} to {group[key]!r} since "
                                     f"compile: compile again")
            groups.append(new)
        return groups

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """Write these hyperparameters (and ``initial_lr``) into a torch optimizer's param groups, as its
        ``load_state_dict`` writes the saved ones (``memgraph.load(path, optimizer=opt)``). Refuses,
        naming it, before writing anything, an optimizer whose update the step does not run: another
        kind, other param groups, or an option the traced update lacks (amsgrad, maximize, ...)."""
        kind = torch_kind(optimizer)
        if kind != self.kind:
            raise ValueError(f"the MemGraph's step runs {self.kind}, not {kind or type(optimizer).__name__}: load "
                             f"it with a {TORCH_CLASSES[self.kind].__name__}")
        groups = optimizer.param_groups
        sizes, want = [len(g["params"]) for g in groups], [len(names) for names in self.params]
        if len(groups) != len(self.groups) or (self.params and sizes != want):
            raise ValueError(f"the optimizer's param groups hold {sizes} parameters, the MemGraph's "
                             f"{want or len(self.groups) * ['?']}")
        defaults = torch_group_defaults(self.kind)
        for g, (group, hp) in enumerate(zip(groups, self.groups)):
            for key in (*structural_options(self.kind), *REFUSED_OPTIONS):
                runs = hp.get(key, defaults.get(key, group.get(key)))
                if key in group and group[key] != runs:
                    raise ValueError(f"param group {g}: {key}={group[key]!r}, which the compiled step does not "
                                     f"run (it runs {key}={runs!r}): load it with an optimizer made with "
                                     f"{key}={runs!r}")
        for group, hp in zip(groups, self.groups):
            group.update({k: v for k, v in hp.items() if k != CARRIED})

    def scalars(self, step: int) -> dict[str, float]:
        """Host scalars for the `step`-th update (1-based), as torch.optim computes them. For a kind
        with HOST_STATES, also records in each group's CARRIED entry the host states after `step`
        (the next step starts from them; see ``carried``)."""
        out: dict[str, float] = {}
        for g, hp in enumerate(self.groups):
            before = self.carried(g, step - 1) if self.kind in HOST_STATES else {}
            values, after = _SCALARS[self.kind](hp, float(step), before)
            if after is not None and step > self.initial_step:
                self._record(g, step, after)
            out.update({f"g{g}.{name}": value for name, value in values.items()})
        return out

    def carried(self, group: int, step: int) -> dict[str, float]:
        """The host states of param group `group` after update `step` (those torch keeps as tensors:
        HOST_STATES), as recorded by ``scalars(step)`` when that step ran; {} before the first update
        (a fresh state, as torch makes it at its first step). A step not recorded (runs restarted
        from an older state) is derived from the latest recorded one before it with the current
        hyperparameters, as it was run unless a scheduler changed them in between."""
        if self.kind not in HOST_STATES:
            return {}
        carried = self.groups[group].setdefault(CARRIED, {})
        if step in carried:
            return dict(carried[step])
        known = [k for k in carried if k < step]
        start = max(known) if known else min(step, self.initial_step)
        state = dict(carried.get(start, {}))
        for k in range(start + 1, step + 1):
            state = _SCALARS[self.kind](self.groups[group], float(k), state)[1]
        return state

    def _record(self, group: int, step: int, after: dict[str, float]) -> None:
        """Keep the host states after `step`, after `step - 1` (a retried step starts from them) and at
        compile (runs restarted from the compiled state start from them); drop the rest."""
        carried = self.groups[group].setdefault(CARRIED, {})
        carried[step] = dict(after)
        for k in [k for k in carried if k not in (step, step - 1, self.initial_step)]:
            del carried[k]


def _round(x: float) -> float:
    """`x` stored in a one-element tensor of torch.optim's state dtype (float32 unless the default dtype is
    float64) and read back, as eager's ``state.copy_(torch.as_tensor(x))`` and ``.item()`` do."""
    return torch.tensor(x, dtype=_scalar_dtype()).item()


# Per kind: (param group, step as a float, host states before the step) -> (the scalars its update's
# ScalarRefs name, the host states after the step, or None for a kind without any). Python floats
# computed as torch.optim's _single_tensor_* functions compute them, operation for operation.
def _sgd(hp: dict, step: float, before: dict):
    first = step == 1
    # buffers start at -0.0: -0.0 * 0 + grad * 1 == grad.clone() bit for bit
    return {"neg_lr": -hp["lr"], "weight_decay": hp["weight_decay"], "momentum": hp["momentum"],
            "buf_scale": 0.0 if first else hp["momentum"], "grad_scale": 1.0 if first else 1 - hp["dampening"]}, None


def _adam(hp: dict, step: float, before: dict):
    lr, wd = hp["lr"], hp["weight_decay"]
    beta1, beta2 = hp["betas"]
    bias_correction1 = 1 - beta1**step  # eager reads the float32 step tensor back as a Python float
    bias_correction2 = 1 - beta2**step
    return {"lr": lr, "beta1": beta1, "one_minus_beta1": 1 - beta1, "beta2": beta2, "one_minus_beta2": 1 - beta2,
            "bias_correction2_sqrt": bias_correction2**0.5, "eps": hp["eps"], "neg_step_size": -(lr / bias_correction1),
            "weight_decay": wd, "decay_factor": 1 - lr * wd}, None


def _adagrad(hp: dict, step: float, before: dict):
    clr = hp["lr"] / (1 + (step - 1) * hp["lr_decay"])
    return {"neg_clr": -clr, "weight_decay": hp["weight_decay"], "eps": hp["eps"]}, None


def _adadelta(hp: dict, step: float, before: dict):
    rho = hp["rho"]
    return {"rho": rho, "one_minus_rho": 1 - rho, "eps": hp["eps"], "neg_lr": -hp["lr"],
            "weight_decay": hp["weight_decay"]}, None


def _adamax(hp: dict, step: float, before: dict):
    beta1, beta2 = hp["betas"]
    clr = hp["lr"] / (1 - beta1**step)
    return {"one_minus_beta1": 1 - beta1, "beta2": beta2, "eps": hp["eps"], "neg_clr": -clr,
            "weight_decay": hp["weight_decay"]}, None


def _nadam(hp: dict, step: float, before: dict):
    lr, wd, decay = hp["lr"], hp["weight_decay"], hp["momentum_decay"]
    beta1, beta2 = hp["betas"]
    mu = beta1 * (1.0 - 0.5 * (0.96 ** (step * decay)))
    mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((step + 1) * decay)))
    # torch keeps mu_product as a tensor: `mu_product *= mu` rounds each product to its dtype
    mu_product = torch.tensor(before.get("mu_product", 1.0), dtype=_scalar_dtype()).mul_(mu).item()
    mu_product_next = mu_product * mu_next
    return {"one_minus_beta1": 1 - beta1, "beta2": beta2, "one_minus_beta2": 1 - beta2,
            "bias_correction2": 1 - beta2**step, "eps": hp["eps"], "weight_decay": wd, "decay_factor": 1 - lr * wd,
            "grad_value": -lr * (1.0 - mu) / (1.0 - mu_product),
            "avg_value": (-lr * mu_next) / (1.0 - mu_product_next)}, {"mu_product": mu_product}


def _radam(hp: dict, step: float, before: dict):
    lr, wd = hp["lr"], hp["weight_decay"]
    beta1, beta2 = hp["betas"]
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * (beta2**step) / bias_correction2
    rectify = rho_t > 5.0
    # unused (the update selects the unrectified step) where torch does not compute it
    rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5 if rectify else 1.0
    return {"one_minus_beta1": 1 - beta1, "beta2": beta2, "one_minus_beta2": 1 - beta2,
            "bias_correction1": bias_correction1, "bias_correction2_sqrt": bias_correction2**0.5, "lr": lr,
            "eps": hp["eps"], "rect": rect, "rectify": 1.0 if rectify else 0.0, "weight_decay": wd,
            "decay_factor": 1 - lr * wd}, None


def _rmsprop(hp: dict, step: float, before: dict):
    alpha = hp["alpha"]
    return {"alpha": alpha, "one_minus_alpha": 1 - alpha, "eps": hp["eps"], "momentum": hp["momentum"],
            "neg_lr": -hp["lr"], "weight_decay": hp["weight_decay"]}, None


def _asgd(hp: dict, step: float, before: dict):
    lr, lambd, alpha = hp["lr"], hp["lambd"], hp["alpha"]
    # torch makes eta from the lr at its first step; later each step sets the next one's eta and mu
    eta = before["eta"] if "eta" in before else _round(lr)
    mu = before.get("mu", 1.0)
    after = {"eta": _round(lr / ((1 + lambd * lr * step) ** alpha)), "mu": _round(1 / max(1, step - hp["t0"]))}
    return {"decay": 1 - lambd * eta, "neg_eta": -eta, "mu": mu, "copy_ax": 1.0 if mu == 1 else 0.0,
            "weight_decay": hp["weight_decay"]}, after


_SCALARS = {"sgd": _sgd, "adam": _adam, "adamw": _adam, "adagrad": _adagrad, "adadelta": _adadelta,
            "adamax": _adamax, "nadam": _nadam, "radam": _radam, "rmsprop": _rmsprop, "asgd": _asgd}


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def update_elements(vertex) -> int:
    """Parameters an optimizer update vertex steps: the elements of the tensors its first argument
    lists (a fused multi-tensor update's parameters; a single tensor's own)."""
    first = vertex.args[0] if vertex.args else ()
    params = first if isinstance(first, (list, tuple)) else (first,)
    return sum(math.prod(ref.size) for ref in params if isinstance(ref, TensorRef))


def state_value_name(param: str, key: str) -> str:
    """The TaskGraph name of optimizer state `key` of parameter `param` (e.g. "opt:fc.weight.exp_avg")."""
    return f"opt:{param}.{key}"


def torch_kind(optimizer: Any) -> str | None:
    """The kind of update a torch optimizer runs ("adamw" for an Adam with decoupled weight decay, as
    compile reads it), None for another class."""
    kind = {cls: name for name, cls in TORCH_CLASSES.items()}.get(type(optimizer))
    if kind == "adam" and any(g.get("decoupled_weight_decay", False) for g in optimizer.param_groups):
        return "adamw"
    return kind


def torch_group_defaults(kind: str) -> dict:
    """The options torch.optim's class for `kind` gives a param group by default ("foreach",
    "maximize", "fused", ...; "params" left out), read from a throwaway instance so they are exactly
    this torch's."""
    return dict(_group_defaults(kind))


@functools.cache
def _group_defaults(kind: str) -> dict:
    cls = TORCH_CLASSES.get(kind)
    if cls is None:
        return {}
    group = cls([torch.zeros(1, requires_grad=True)]).param_groups[0]
    return {k: v for k, v in group.items() if k != "params"}

def mark_stepped(optimizer: Any) -> None:
    """Record that an update ran, as ``optimizer.step()`` does for LR schedulers.

    torch.optim.lr_scheduler wraps ``optimizer.step`` to set ``optimizer._opt_called`` and warns, at
    the scheduler's first step(), "Detected call of `lr_scheduler.step()` before
    `optimizer.step()`" when it is unset. engine.run applies the update without calling step(), so
    after each completed step it marks ``mg.optimizer`` (a CompiledOptimizer, or a torch optimizer
    set in its place) and the user's torch optimizer a CompiledOptimizer follows: a scheduler on
    either then sees the update it follows, as in eager."""
    if optimizer is None:
        return
    optimizer._opt_called = True
    wrapped = getattr(optimizer, "_torch", None) if isinstance(optimizer, CompiledOptimizer) else None
    if wrapped is not None:
        wrapped._opt_called = True


def _scalar_dtype() -> torch.dtype:
    """The dtype torch.optim gives the "step" tensors it creates (torch.optim.optimizer._get_scalar_dtype)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class CompiledOptimizer(torch.optim.Optimizer):
    """``mg.optimizer``: the optimizer of a compiled step, as torch.optim sees optimizers.

    param_groups: the torch optimizer's given to compile (the very dicts: an LR scheduler stepped on
    either changes what the next engine.run uses), or for a MemGraph without one (loaded from a file),
    groups made from the saved hyperparameters (the saved optimizer's param groups when it was saved,
    a scheduler's step after the last run and its ``initial_lr`` included), torch's defaults for
    the kind's other options, and parameter names for parameters; a scheduler stepped on this
    optimizer changes what the next engine.run uses there too.
    state / state_dict(): the step's current optimizer states (after the last engine.run), read from
    the MemGraph's homes, keyed as torch.optim keys them, so
    ``opt.load_state_dict(mg.optimizer.state_dict())`` lets an eager optimizer over the same
    parameters (model.load_state_dict(mg.state_dict())) go on exactly where the compiled step stopped.
    The step itself runs through engine.run only: step() and load_state_dict() refuse.
    """

    def __init__(self, mg: Any, optimizer: torch.optim.Optimizer | None = None):
        # Optimizer.__init__ is not called: it copies the groups (a scheduler on the user's optimizer would
        # no longer reach the step) and needs parameter tensors, which a loaded MemGraph does not have
        spec = mg.taskgraph.optimizer
        if spec is None:
            raise ValueError("the MemGraph was compiled without an optimizer")
        self._memgraph = weakref.ref(mg)  # no cycle: mg holds this, and its runtime holds the arena
        self._torch = optimizer
        if optimizer is not None and [len(g["params"]) for g in optimizer.param_groups] != [len(n) for n in spec.params]:
            raise ValueError("the optimizer's param groups are not the ones the MemGraph was compiled with")
        if optimizer is not None:
            self._groups = None
            self.defaults = dict(optimizer.defaults)
        else:
            if spec.params and len(spec.params) != len(spec.groups):
                raise ValueError(f"the MemGraph's optimizer has {len(spec.groups)} param groups but parameter "
                                 f"names for {len(spec.params)}")
            defaults = torch_group_defaults(spec.kind)
            names = spec.params or [[] for _ in spec.groups]  # a spec made by hand may name no parameters
            self._groups = [{**defaults, **{k: v for k, v in hp.items() if k != CARRIED}, "params": list(group)}
                            for hp, group in zip(spec.groups, names)]
            self.defaults = defaults
        for hooks in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
                      "load_state_dict_post"):
            setattr(self, f"_optimizer_{hooks}_hooks", OrderedDict())

    @property
    def param_groups(self) -> list[dict]:
        return self._torch.param_groups if self._torch is not None else self._groups

    def _live(self):
        mg = self._memgraph()
        if mg is None:
            raise RuntimeError("the MemGraph of this optimizer no longer exists")
        return mg, mg.taskgraph.optimizer

    def steps_taken(self) -> int:
        """Updates the compiled step has applied (those of the torch optimizer before compile included)."""
        mg, spec = self._live()
        if mg.runtime is not None:
            return int(mg.runtime.step)
        return int(mg.stats.get("step", spec.initial_step))

    def _states(self) -> list[dict[str, torch.Tensor] | None]:
        """Per parameter, in torch's numbering: its state as torch.optim would hold it, None where torch
        would hold none (no update taken yet, SGD without momentum, a parameter that gets no gradient).
        Adagrad makes its states when it is made, so they are there before the first update too."""
        mg, spec = self._live()
        steps = self.steps_taken()
        by_name = {v.name: v.id for v in mg.taskgraph.values if v.name.startswith("opt:")}
        if steps == 0 and spec.kind != "adagrad":
            return [None] * sum(len(group) for group in spec.params)
        tensors = mg.runtime.persistent_state(mg) if mg.runtime is not None else mg.initial_state
        host = HOST_STATES.get(spec.kind, ())
        out = []
        for g, group in enumerate(spec.params):
            carried = spec.carried(g, steps) if host else {}
            for name in group:
                tensors_of = {}
                for key in spec.state_keys():
                    vid = by_name.get(state_value_name(name, key))
                    if vid is not None:
                        tensors_of[key] = tensors[vid].detach().clone()
                if not tensors_of:  # no update reached this parameter
                    out.append(None)
                    continue
                state = {}
                for key in spec.state_keys():
                    if key == "step":
                        state[key] = torch.tensor(float(steps), dtype=_scalar_dtype())
                    elif key in host:
                        default = _round(spec.groups[g]["lr"]) if key == "eta" else 1.0
                        state[key] = torch.tensor(carried.get(key, default), dtype=_scalar_dtype())
                    elif key in tensors_of:
                        state[key] = tensors_of[key]
                out.append(state)
        return out

    @property
    def state(self) -> dict:
        """{parameter: {"exp_avg": ..., ...}} as torch.optim's ``opt.state`` (CPU copies; keyed by
        parameter name for a MemGraph without its torch optimizer)."""
        params = [p for g in self.param_groups for p in g["params"]]
        return {p: st for p, st in zip(params, self._states(), strict=True) if st is not None}

    def state_dict(self) -> dict:
        """{"state": {index: {...}}, "param_groups": [{..., "params": [index, ...]}]}, as
        torch.optim.Optimizer.state_dict gives it, with the step's current states."""
        states = self._states()
        groups, start = [], 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            groups.append(packed)
        return {"state": {i: st for i, st in enumerate(states) if st is not None}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        raise NotImplementedError(
            "a compiled step's optimizer states are loaded at compile: load the state dict into the torch "
            "optimizer (opt.load_state_dict(...)) and compile with it, which starts from its states and step")

    def step(self, closure=None):
        raise RuntimeError("the compiled step applies its optimizer update inside engine.run(mg, batch)")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the compiled step keeps no gradients between steps."""

    def __repr__(self) -> str:
        kind = type(self._torch).__name__ if self._torch is not None else self._live()[1].kind
        return f"CompiledOptimizer({kind}, {len(self.param_groups)} param groups, {self.steps_taken()} steps)"
