"""One benchmark workload compiled for a diagnosis tool (loop_profile, repeatability): the arguments
that name it and its budget, the compile, and the batch engine.run takes.

    add_arguments(parser, budget=0.5)
    compiled = compile_from(args)     # .workload, .mg, .batch
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from .. import memgraph
from .models.sizes import make_workload
from .options import budget_arg
from .peers.common import Workload, trainable
from .peers.turnip_system import budget_argument


@dataclass
class Compiled:
    workload: Workload
    mg: memgraph.MemGraph
    batch: object  # one device's batch, or one per device (from host memory: each device copies its own)


def add_arguments(parser: argparse.ArgumentParser, budget: float) -> None:
    parser.add_argument("--model", default="gpt1.3b")
    parser.add_argument("--tiny", action="store_true", help="the model's tiny configuration (CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--budget", type=budget_arg, default=budget,
                        help="a fraction of --eager-peak (else of the unplanned peak), or bytes")
    parser.add_argument("--eager-peak", type=int, default=None, help="bytes a fractional budget is of")


def compile_from(args: argparse.Namespace) -> Compiled:
    """The workload of ``args`` compiled on ``args.devices`` devices within its budget: a fraction of
    ``--eager-peak`` where given, else of the unplanned peak, or bytes."""
    workload = make_workload(args.model, tiny=args.tiny)
    budget, _ = budget_argument(args.budget, args.eager_peak)
    mg = memgraph.compile(workload.model, workload.loss_fn, workload.batch_on(args.device),
                          optimizer=workload.optimizer(trainable(workload.model)), budget=budget, device=args.device,
                          devices=args.devices, verbose=False)
    batch = ([workload.batch_on("cpu") for _ in range(args.devices)] if args.devices > 1
             else workload.batch_on(args.device))
    return Compiled(workload, mg, batch)
