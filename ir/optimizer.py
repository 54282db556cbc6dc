"""OptimizerSpec: the optimizer kind and hyperparameters a traced TaskGraph updates with.

Plain data (it is saved with the graph); ``scalars`` turns it into the host
scalars each step's `ScalarRef`s resolve to. Read from a torch optimizer by
``memgraph.optim.spec_from_optimizer``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OptimizerSpec:
    kind: str  # "sgd" | "adam" | "adamw"
    groups: list[dict] = field(default_factory=list)  # per param group: lr, betas, eps, weight_decay, momentum, ...
    initial_step: int = 0  # steps the torch optimizer had already taken

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
