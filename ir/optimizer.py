"""The optimizer a compiled step applies: its spec (saved with the graph) and its torch-facing view.

OptimizerSpec is plain data (it is saved with the graph); ``scalars`` turns it
into the host scalars each step's `ScalarRef`s resolve to. Read from a torch
optimizer by ``memgraph.optim.spec_from_optimizer``.

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
import math
import numbers
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from .taskgraph import TensorRef

# hyperparameters a step reads as host scalars, so an LR scheduler (or a user) may change them between
# steps; a change that alters the traced update itself (a zero becoming non-zero) needs a new compile
SCHEDULABLE = ("lr", "betas", "eps", "momentum", "dampening", "weight_decay")
STRUCTURAL_ZERO = ("momentum", "weight_decay")  # zero or not decides which ops were traced
# what an LR scheduler keeps in a param group beside the hyperparameters: the lr it scales (torch's
# schedulers need it to resume with last_epoch >= 0). Followed and saved, never read by the step.
SCHEDULER_KEYS = ("initial_lr",)
# options of torch's optimizers the traced update does not run (compile refuses them too)
REFUSED_OPTIONS = ("amsgrad", "maximize", "differentiable")


@dataclass
class OptimizerSpec:
    kind: str  # "sgd" | "adam" | "adamw"
    groups: list[dict] = field(default_factory=list)  # per param group: lr, betas, eps, weight_decay, momentum, ...
    initial_step: int = 0  # steps the torch optimizer had already taken
    # per param group, the model's names of its parameters in the group's order (torch numbers the
    # parameters of a state_dict in this order)
    params: list[list[str]] = field(default_factory=list)

    def state_keys(self) -> tuple[str, ...]:
        """The tensors torch.optim keeps per parameter for this kind (SGD: only with momentum)."""
        return ("momentum_buffer",) if self.kind == "sgd" else ("step", "exp_avg", "exp_avg_sq")

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
        return dataclasses.replace(self, groups=self._followed_groups(param_groups),
                                   params=[list(names) for names in self.params])

    def _followed_groups(self, param_groups: list[dict]) -> list[dict]:
        if len(param_groups) != len(self.groups):
            raise ValueError(f"the optimizer has {len(param_groups)} parameter groups, the compiled step "
                             f"{len(self.groups)}: compile again after adding groups")
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
            for key, old in hp.items():
                if key not in SCHEDULABLE and key not in SCHEDULER_KEYS and group.get(key, old) != old:
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
        for g, group in enumerate(groups):
            for key in REFUSED_OPTIONS:
                if key in group and group[key] != defaults.get(key, group[key]):
                    raise ValueError(f"param group {g}: {key}={group[key]!r}, which the compiled step does not "
                                     f"run: load it with an optimizer made without it")
        for group, hp in zip(groups, self.groups):
            group.update(hp)

    def scalars(self, step: int) -> dict[str, float]:
        """Host scalars for the `step`-th update (1-based), as torch.optim computes them."""
        out: dict[str, float] = {}
        for g, hp in enumerate(self.groups):
            lr, wd = hp["lr"], hp["weight_decay"]
            if self.kind == "sgd":
                first = step == 1
                out[f"g{g}.neg_lr"] = -lr
                out[f"g{g}.weight_decay"] = wd
                out[f"g{g}.momentum"] = hp["momentum"]
                # buffers start at -0.0: -0.0 * 0 + grad * 1 == grad.clone() bit for bit
                out[f"g{g}.buf_scale"] = 0.0 if first else hp["momentum"]
                out[f"g{g}.grad_scale"] = 1.0 if first else 1 - hp["dampening"]
            else:
                beta1, beta2 = hp["betas"]
                step_f = float(step)  # eager reads the float32 step tensor back as a Python float
                bias_correction1 = 1 - beta1**step_f
                bias_correction2 = 1 - beta2**step_f
                step_size = lr / bias_correction1
                out[f"g{g}.lr"] = lr
                out[f"g{g}.beta1"] = beta1
                out[f"g{g}.one_minus_beta1"] = 1 - beta1
                out[f"g{g}.beta2"] = beta2
                out[f"g{g}.one_minus_beta2"] = 1 - beta2
                out[f"g{g}.bias_correction2_sqrt"] = bias_correction2**0.5
                out[f"g{g}.eps"] = hp["eps"]
                out[f"g{g}.neg_step_size"] = -step_size
                out[f"g{g}.weight_decay"] = wd
                out[f"g{g}.decay_factor"] = 1 - lr * wd
        return out


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


# the torch.optim class of each kind, whose defaults fill a loaded step's param groups
TORCH_CLASSES = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


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
            self._groups = [{**defaults, **hp, "params": list(group)} for hp, group in zip(spec.groups, names)]
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
        would hold none (no update taken yet, SGD without momentum, a parameter that gets no gradient)."""
        mg, spec = self._live()
        steps = self.steps_taken()
        by_name = {v.name: v.id for v in mg.taskgraph.values if v.name.startswith("opt:")}
        names = [name for group in spec.params for name in group]
        if steps == 0:
            return [None] * len(names)
        tensors = mg.runtime.persistent_state(mg) if mg.runtime is not None else mg.initial_state
        out = []
        for name in names:
            state = {}
            for key in spec.state_keys():
                if key == "step":
                    continue
                vid = by_name.get(state_value_name(name, key))
                if vid is not None:
                    state[key] = tensors[vid].detach().clone()
            if state and "step" in spec.state_keys():
                state = {"step": torch.tensor(float(steps), dtype=_scalar_dtype()), **state}
            out.append(state or None)
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
