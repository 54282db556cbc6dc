"""OptimizerSpec: the optimizer kind and hyperparameters a traced TaskGraph updates with.

Plain data (it is saved with the graph); ``scalars`` turns it into the host
scalars each step's `ScalarRef`s resolve to. Read from a torch optimizer by
``memgraph.optim.spec_from_optimizer``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

# hyperparameters a step reads as host scalars, so an LR scheduler (or a user) may change them between
# steps; a change that alters the traced update itself (a zero becoming non-zero) needs a new compile
SCHEDULABLE = ("lr", "betas", "eps", "momentum", "dampening", "weight_decay")
STRUCTURAL_ZERO = ("momentum", "weight_decay")  # zero or not decides which ops were traced


@dataclass
class OptimizerSpec:
    kind: str  # "sgd" | "adam" | "adamw"
    groups: list[dict] = field(default_factory=list)  # per param group: lr, betas, eps, weight_decay, momentum, ...
    initial_step: int = 0  # steps the torch optimizer had already taken

    def follow(self, param_groups: list[dict]) -> None:
        """Take the torch optimizer's current hyperparameters (set by an LR scheduler, say), so the
        next step uses them as eager's would. Refuses, naming it, a change the traced update
        cannot follow: a different number of groups, a tensor value, a hyperparameter becoming zero
        or non-zero where that decides which ops run, or any other option (nesterov, amsgrad, ...)."""
        if len(param_groups) != len(self.groups):
            raise ValueError(f"the optimizer has {len(param_groups)} parameter groups, the compiled step "
                             f"{len(self.groups)}: compile again after adding groups")
        for g, (group, hp) in enumerate(zip(param_groups, self.groups)):
            new = dict(hp)
            for key in SCHEDULABLE:
                if key not in hp:
                    continue
                value = group[key]
                values = value if key == "betas" else (value,)
                if not all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in values):
                    raise ValueError(f"param group {g}: {key}={value!r}; the compiled step takes Python numbers")
                new[key] = tuple(float(x) for x in value) if key == "betas" else value
                if key in STRUCTURAL_ZERO and (hp[key] == 0) != (value == 0):
                    raise ValueError(f"param group {g}: {key} changed from {hp[key]} to {value}, which changes "
                                     f"the traced update: compile again")
            for key, old in hp.items():
                if key not in SCHEDULABLE and group.get(key, old) != old:
                    raise ValueError(f"param group {g}: {key} changed from {old!r} to {group[key]!r} since "
                                     f"compile: compile again")
            self.groups[g] = new

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
