"""Demo: compile a small GPT under a memory budget and train a few steps, checking against eager.

    python -m turnip.demo [--budget 0.5] [--steps 3] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import copy
import logging
import time

import torch

from turnip import engine, memgraph
from turnip.bench.models.gpt import GPT, GPTConfig, example_batch, lm_loss
from turnip.ir.budget import format_bytes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="0.5", help="bytes, '6GiB', or a fraction of the unplanned peak")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default=None, help="cuda if available, else cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--planner", default="auto")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    budget = float(args.budget) if args.budget.replace(".", "", 1).isdigit() and "." in args.budget else args.budget

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=512, seq=64, d_model=128, n_layers=args.layers, n_heads=4, dropout=0.1)
    model = GPT(cfg).to(device)
    eager_model = copy.deepcopy(model)
    batches = [example_batch(cfg, batch=4, device=device, seed=i) for i in range(args.steps)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    started = time.perf_counter()
    mg = memgraph.compile(model, lm_loss, batches[0], optimizer=optimizer, budget=budget, device=device,
                          planner=args.planner)
    summary = mg.summary()
    print(f"compiled in {time.perf_counter() - started:.1f}s for {device}: arena {format_bytes(mg.arena_bytes)} "
          f"(unplanned peak {format_bytes(mg.stats['unplanned_peak'])}), {summary['vertices']} vertices, "
          f"{format_bytes(summary['bytes_offloaded'])} offloaded per step, planner {summary['planner']}")

    torch.manual_seed(1)
    losses = []
    for step, batch in enumerate(batches, 1):
        t0 = time.perf_counter()
        loss = engine.run(mg, batch)["loss"].item()
        losses.append(loss)
        print(f"step {step}: loss {loss:.6f} ({(time.perf_counter() - t0) * 1e3:.1f} ms)")

    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    for batch in batches:
        eager_opt.zero_grad()
        eager_loss = lm_loss(eager_model, batch)
        eager_loss.backward()
        eager_opt.step()
    model.load_state_dict(mg.state_dict())
    worst = max((a.float() - b.float()).abs().max().item()
                for a, b in zip(model.state_dict().values(), eager_model.state_dict().values()))
    print(f"eager final loss {eager_loss.item():.6f}; largest weight difference vs eager: {worst:.3g}")
    return 0 if worst <= (0 if device == "cpu" else 1e-3) else 1


if __name__ == "__main__":
    raise SystemExit(main())
