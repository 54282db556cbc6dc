"""Does one compiled step give the same numbers twice? Where do two runs first part?

    python -m turnip.bench.repeatability --model gpt1.3b --devices 2 --budget 1.0 --eager-peak 39829110784
    python -m turnip.bench.repeatability --tiny --device cpu --devices 2 --budget 0.5     # CPU, seconds
    python -m turnip.bench.repeatability --model gpt1.3b --eager      # eager PyTorch's own spread, one device

Compiles the workload once, runs ``--steps`` steps, starts over from the compiled weights
(``mg.release(keep=False)``) and runs them again, ``--runs`` times in all. After every step it keeps
the loss and a fingerprint of every weight (``mg.state_dict()``: its bits summed as integers, and its
values summed in float64), and reports, per step, whether every run matched the first bitwise and,
where not, which weights differ (the first in the model's order, and how many). On the CPU backend
every run must match (tests/test_repeatability_bench.py); on two H200s the second step's loss of
gpt1.3b took six values over one session's runs where DDP's took two values 1e-6 apart
(bench/results/2026-11-29_h200x2_reserved-within-budget-loop-variance.md): the first weights to differ
after step 1 say which kernels to look at. ``--eager`` runs eager PyTorch the same way (a fresh copy of
the model per run, the optimizer's fused kernel on CUDA, the kernel turnip runs there): the yardstick for
turnip's spread. Writes bench/results/repeatability_<model>_x<N>.json (``_eager.json``).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from .. import engine
from .models.sizes import make_workload
from .one_memgraph import add_arguments, compile_from
from .peers.common import is_cuda, trainable
from .peers.eager import training_step
from .results import result_path, run_metadata

log = logging.getLogger(__name__)


def fingerprint(tensor: torch.Tensor) -> tuple[int, float]:
    """(the tensor's bytes summed as 32-bit or 16-bit integers, its values summed in float64): equal
    bits give equal fingerprints; one flipped bit changes the first."""
    flat = tensor.detach().contiguous().view(-1)
    width = {4: torch.int32, 2: torch.int16, 1: torch.uint8, 8: torch.int64}[flat.element_size()]
    return int(flat.view(width).to(torch.int64).sum()), float(flat.to(torch.float64).sum())


def fingerprints(mg) -> dict[str, tuple[int, float]]:
    return {name: fingerprint(t) for name, t in mg.state_dict().items()}


def runs_of(mg, batch, steps: int, runs: int, device: str) -> list[list[dict]]:
    """Per run, per step: the loss and every weight's fingerprint after it. Each run starts from the
    compiled weights."""
    out = []
    for _ in range(runs):
        mg.release(keep=False)
        run = []
        for _ in range(steps):
            loss = float(engine.run(mg, batch)["loss"])
            if is_cuda(device):
                torch.cuda.synchronize()
            run.append({"step": mg.runtime.step, "loss": loss, "weights": fingerprints(mg)})
        out.append(run)
    mg.release(keep=False)
    return out


def eager_runs(workload, device: str, steps: int, runs: int) -> list[list[dict]]:
    """As runs_of, for eager PyTorch on one device: each run a fresh copy of the workload's model and
    optimizer (its fused kernel on CUDA), the same batch every step."""
    out = []
    for _ in range(runs):
        model = workload.fresh_model(device)
        optimizer = workload.optimizer(trainable(model), fused=is_cuda(device))
        batch = workload.batch_on(device)
        run = []
        for step in range(1, steps + 1):
            loss = float(training_step(model, workload.loss_fn, batch, optimizer).detach())
            if is_cuda(device):
                torch.cuda.synchronize()
            run.append({"step": step, "loss": loss,
                        "weights": {name: fingerprint(t) for name, t in model.state_dict().items()}})
        out.append(run)
        del model, optimizer
    return out


def compared(runs: list[list[dict]]) -> list[dict]:
    """Per step: whether every run matched the first (loss and weights, bitwise), the losses, and the
    weights that differ from the first run's in any run, in the first run's order."""
    rows = []
    for k, first in enumerate(runs[0]):
        others = [run[k] for run in runs[1:]]
        differ = [name for name in first["weights"]
                  if any(other["weights"][name] != first["weights"][name] for other in others)]
        rows.append({"step": first["step"], "losses": [first["loss"]] + [o["loss"] for o in others],
                     "same": not differ and all(o["loss"] == first["loss"] for o in others),
                     "weights_differ": len(differ), "weights": len(first["weights"]), "first_differ": differ[:20]})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnip.bench.repeatability", description=__doc__.split("\n\n")[0])
    add_arguments(parser, budget=1.0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="eager PyTorch instead of turnip, on one device: "
                        "its own run-to-run spread")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.runs < 2 or args.steps < 1:
        parser.error("--runs must be at least 2 and --steps at least 1")
    if args.eager and args.devices != 1:
        parser.error("--eager runs on one device (--devices 1)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    if args.eager:
        workload = make_workload(args.model, tiny=args.tiny)
        rows = compared(eager_runs(workload, args.device, args.steps, args.runs))
        system = {"system": "eager", "budget": None, "budget_bytes": None, "planner": None}
    else:
        compiled = compile_from(args)
        mg, workload = compiled.mg, compiled.workload
        rows = compared(runs_of(mg, compiled.batch, args.steps, args.runs, args.device))
        system = {"system": "turnip", "budget": args.budget, "budget_bytes": mg.plan.gpu_budget,
                  "planner": mg.plan.planner}
    doc = {"benchmark": "repeatability", **run_metadata(), "model": workload.name, "devices": args.devices,
           **system, "steps": rows}
    suffix = "eager" if args.eager else f"x{args.devices}"
    out = Path(args.out) if args.out else result_path(f"repeatability_{workload.name}_{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    for row in rows:
        log.info("step %d: %s; losses %s%s", row["step"], "every run the same, bitwise" if row["same"] else
                 f"{row['weights_differ']} of {row['weights']} weights differ", row["losses"],
                 f"; first: {', '.join(row['first_differ'][:5])}" if row["first_differ"] else "")
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
