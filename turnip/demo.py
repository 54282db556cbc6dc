"""Demo: compile a small GPT under a memory budget, train it a few steps beside eager PyTorch.

    python -m turnip.demo [--budget 0.5] [--steps 6] [--device cuda|cpu]

The GPT (vocabulary 512, 4 layers, width 128, dropout 0.1) starts from GPT-2's initialisation,
so its first loss is near ln(512) = 6.24. It trains on two batches of random tokens, taken in
turn, so the loss falls. turnip's step and eager PyTorch's step run from the same weights and
the same random seed; the demo prints both losses per step, the compile report and the memory
saved, then compares the trained weights: bitwise equal on the CPU backend (exit status 0),
within float tolerance on CUDA.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import sys
import time

import torch
from torch import nn

from . import engine, memgraph
from .gpt import GPT, GPTConfig, example_batch, lm_loss
from .ir.budget import format_bytes
from .memgraph.compiler import report_printed
from .memgraph.report import compile_report

VOCAB = 512
DISTINCT_BATCHES = 2


def gpt2_init(model: GPT) -> GPT:
    """GPT-2's initialisation: weights N(0, 0.02), biases 0, residual projections scaled by
    1/sqrt(2 * layers). turnip/gpt.py keeps PyTorch's defaults (N(0, 1) embeddings, tied to
    the head, give a first loss near 78 on this vocabulary); the benchmarks depend on those."""
    layers = len(model.blocks)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj", "fc_out")) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
    return model


def eager_steps(model: nn.Module, batches: list, lr: float) -> tuple[list[float], list[float], int | None]:
    """(losses, seconds per step, peak CUDA bytes or None) of eager PyTorch on `model`."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(batch) -> float:
        optimizer.zero_grad()
        loss = lm_loss(model, batch)
        loss.backward()
        optimizer.step()
        return loss.item()

    return timed_steps(next(model.parameters()).is_cuda, batches, step)


def turnip_steps(mg, batches: list) -> tuple[list[float], list[float], int | None]:
    return timed_steps(mg.device.startswith("cuda"), batches, lambda batch: engine.run(mg, batch)["loss"].item())


def timed_steps(cuda: bool, batches: list, step) -> tuple[list[float], list[float], int | None]:
    """Run step(batch) -> loss for each batch from the same RNG seed: (losses, seconds per step,
    peak CUDA bytes over the steps or None)."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, seconds = [], []
    torch.manual_seed(1)
    for batch in batches:
        t0 = time.perf_counter()
        losses.append(step(batch))
        seconds.append(time.perf_counter() - t0)
    return losses, seconds, torch.cuda.max_memory_allocated() if cuda else None


def loss_table(turnip_losses, turnip_s, eager_losses, eager_s) -> str:
    lines = [f"{'step':>4}  {'turnip loss':>12}  {'eager loss':>12}  {'same':>4}  {'turnip ms':>9}  {'eager ms':>8}"]
    for k, (a, sa, b, sb) in enumerate(zip(turnip_losses, turnip_s, eager_losses, eager_s), 1):
        same = "yes" if a == b else f"{abs(a - b):.1e}"
        lines.append(f"{k:>4}  {a:>12.6f}  {b:>12.6f}  {same:>4}  {sa * 1e3:>9.1f}  {sb * 1e3:>8.1f}")
    return "\n".join(lines)


def memory_saved(mg, turnip_peak: int | None, eager_peak: int | None) -> str:
    peak, used = mg.stats["unplanned_peak"], mg.arena_bytes + mg.taskgraph.step_workspace()
    text = (f"memory: the step runs in {format_bytes(used)} (arena and op workspace) where keeping everything "
            f"takes {format_bytes(peak)}: {format_bytes(peak - used)} saved ({1 - used / peak:.0%})")
    if turnip_peak is not None and eager_peak is not None:
        text += (f"; measured peak GPU memory {format_bytes(turnip_peak)} against eager's {format_bytes(eager_peak)} "
                 f"({1 - turnip_peak / eager_peak:.0%} less)")
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnip.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="0.5",
                        help="a fraction of the unplanned peak (0.5, '50%%') or a size ('6GiB'); default 0.5")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default=None, help="cuda if available, else cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--planner", default="auto", help="auto, ilp, greedy or none")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("-v", "--verbose", action="store_true", help="log turnip's INFO messages")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=VOCAB, seq=64, d_model=128, n_layers=args.layers, n_heads=4, dropout=0.1)
    model = gpt2_init(GPT(cfg)).to(device)
    eager_model = copy.deepcopy(model)
    data = [example_batch(cfg, batch=4, device=device, seed=i) for i in range(DISTINCT_BATCHES)]
    batches = [data[k % DISTINCT_BATCHES] for k in range(args.steps)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    print(f"GPT with {sum(p.numel() for p in model.parameters()):,} parameters on {device}; "
          f"a first loss near ln({VOCAB}) = {math.log(VOCAB):.2f}")
    try:
        mg = memgraph.compile(model, lm_loss, batches[0], optimizer=optimizer, budget=args.budget, device=device,
                              planner=args.planner)
    except ValueError as err:  # an unreadable budget, or one below what the step can run in
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not report_printed(verbose=True):
        print(compile_report(mg))

    turnip_losses, turnip_s, turnip_peak = turnip_steps(mg, batches)
    eager_losses, eager_s, eager_peak = eager_steps(eager_model, batches, args.lr)
    print(loss_table(turnip_losses, turnip_s, eager_losses, eager_s))
    print(memory_saved(mg, turnip_peak, eager_peak))

    model.load_state_dict(mg.state_dict())
    worst = max((a.float() - b.float()).abs().max().item()
                for a, b in zip(model.state_dict().values(), eager_model.state_dict().values()))
    exact = device == "cpu"
    ok = worst <= (0 if exact else 1e-3)
    print(f"trained weights vs eager: largest difference {worst:.3g} "
          f"({'bitwise equal' if worst == 0 else 'within tolerance' if ok else 'MISMATCH'})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
