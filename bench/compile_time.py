"""How long memgraph.compile takes for a small Hugging Face GPT-2 on the CPU backend.

    python -m turnip.bench.compile_time [--budget 0.5] [--planners auto,greedy]

A 30M-parameter GPT-2 (GPT2Config(n_embd=384, n_layer=6, n_head=6, n_positions=256), batch
4 x 128, AdamW), compiled with each planner at the budget (a fraction of the unplanned peak):
wall seconds of compile, the planner that won, the solver's status and seconds, and the
predicted step time. Writes bench/results/compile_time.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch
from turnip.bench.results import result_path, run_metadata

from turnip import memgraph

log = logging.getLogger(__name__)


def gpt2_30m():
    import transformers  # optional: the bench extra

    cfg = transformers.GPT2Config(n_embd=384, n_layer=6, n_head=6, n_positions=256)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    batch = torch.randint(0, cfg.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    return model, batch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--planners", default="auto,greedy")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    model, batch = gpt2_30m()
    rows = []
    for planner in args.planners.split(","):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        started = time.perf_counter()
        mg = memgraph.compile(model, lambda m, b: m(input_ids=b, labels=b).loss, batch, optimizer=opt,
                              budget=args.budget, device="cpu", planner=planner, verbose=False)
        seconds = time.perf_counter() - started
        rows.append({"planner_requested": planner, "compile_s": seconds, "planner": mg.plan.planner,
                     "status": mg.plan.stats.get("status"), "solve_s": mg.plan.stats.get("solve_seconds"),
                     "predicted_step_s": mg.plan.predicted_time})
        print(f"{planner:8s} compile {seconds:5.1f} s  planner {mg.plan.planner}  "  # noqa: T201 - the report
              f"status {rows[-1]['status']}  predicted {mg.plan.predicted_time * 1e3:.1f} ms")
    result = {"benchmark": "compile_time", **run_metadata(), "model": "hf gpt2 30M", "budget": args.budget,
              "parameters": sum(p.numel() for p in model.parameters()), "rows": rows}
    path = result_path("compile_time.json")
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {path}")  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
