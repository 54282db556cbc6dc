"""planners/problem.py reload_room: a planned reload holds its bytes from its prefetch window."""

from __future__ import annotations

import torch
from turnip.planners.model import OFFLOAD
from turnip.planners.problem import build_problem
from turnip.trace.tracer import trace

from turnip import gpt


def _byte_positions(option) -> int:
    return sum((last - first + 1) * b for first, last, b in option.intervals)


def test_reload_room_counts_reloads_from_their_prefetch_window():
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(vocab=128, seq=32, d_model=32, n_layers=4, n_heads=2)
    model = gpt.GPT(cfg)
    tg = trace(model, gpt.lm_loss, gpt.example_batch(cfg, batch=4),
                            optimizer=torch.optim.AdamW(model.parameters()), device=torch.device("cpu"))
    for v in tg.vertices:
        v.time = 1e-5
    options = {}
    for room in (False, True):
        problem = build_problem(tg, 1 << 40, bw_h2d=1e10, bw_d2h=1e10, alignment=64, windows=12, reload_room=room)
        options[room] = [[_byte_positions(o) for o in g.options if o.kind == OFFLOAD] for g in problem.groups]
    flat = {room: [x for group in opts for x in group] for room, opts in options.items()}
    assert flat[False] and len(flat[False]) == len(flat[True])
    assert all(t >= f for f, t in zip(flat[False], flat[True]))  # never less memory than without
    assert any(t > f for f, t in zip(flat[False], flat[True]))  # and more wherever the window starts earlier
