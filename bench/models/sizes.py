"""The benchmark's workloads by name: GPT-style models at ~350M and ~1.3B parameters, a LoRA 1.3B, Llama,
a LoRA Llama-2-7B and a ~0.93B Mixtral.

    workload = make_workload("gpt1.3b")             # canonical CPU model + bf16-autocast loss + batch + AdamW
    workload = make_workload("gpt1.3b", tiny=True)   # same shape of workload, CPU-sized (CI, --tiny)

All use vocab 50304 (GPT-2's, padded to a multiple of 64), sequence 1024, fp32
weights and AdamW (fp32 states), with the forward and loss under bf16 autocast:
the usual mixed-precision recipe, so every system does the same math.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
import torch.nn.functional as F

from ...gpt import GPT, GPTConfig, example_batch
from ..peers.common import OptimizerSpec, Workload, parameter_count
from .llama import llama_workload, lora_workload
from .mixtral import mixtral_workload

VOCAB, SEQ = 50304, 1024
GPT_SIZES = {
    "gpt350m": {"d_model": 1024, "n_layers": 24, "n_heads": 16},  # 355M parameters
    "gpt1.3b": {"d_model": 2048, "n_layers": 24, "n_heads": 16},  # 1.31B parameters
    "lora1.3b": {"d_model": 2048, "n_layers": 24, "n_heads": 16, "lora_rank": 16},  # frozen 1.3B base, rank-16 adapters
}
BATCH = {"gpt350m": 8, "gpt1.3b": 8, "lora1.3b": 8}
# Tiny: small enough for the CPU backend in seconds, vocabulary small enough that activations (not the
# logits) dominate the peak, so a 0.5 budget is feasible by offloading.
TINY_GPT = {"vocab": 64, "seq": 32, "d_model": 64, "n_layers": 3, "n_heads": 4}
TINY_BATCH = 4
MODELS = (*GPT_SIZES, "llama")


def autocast_lm_loss(model, batch) -> torch.Tensor:
    """Next-token cross-entropy with the forward under bf16 autocast (cross-entropy itself runs in fp32)."""
    idx, targets = batch
    with torch.autocast(idx.device.type, dtype=torch.bfloat16):
        logits = model(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_config(name: str, tiny: bool = False) -> GPTConfig:
    if name not in GPT_SIZES:
        raise KeyError(f"unknown GPT size {name!r} (known: {', '.join(GPT_SIZES)})")
    lora = GPT_SIZES[name].get("lora_rank", 0)
    if tiny:
        return GPTConfig(**TINY_GPT, lora_rank=min(lora, 4))
    return GPTConfig(vocab=VOCAB, seq=SEQ, **GPT_SIZES[name])


def gpt_workload(name: str, tiny: bool = False, batch: int | None = None, seed: int = 0, lr: float = 1e-4) -> Workload:
    cfg = gpt_config(name, tiny)
    torch.manual_seed(seed)
    model = GPT(cfg)
    size = batch or (TINY_BATCH if tiny else BATCH[name])
    info = {"config": asdict(cfg), "batch_size": size, "seq": cfg.seq, "loss": "bf16 autocast, fp32 cross-entropy",
            **parameter_count(model)}
    return Workload(name + ("-tiny" if tiny else ""), model, autocast_lm_loss, example_batch(cfg, batch=size, seed=seed),
                    OptimizerSpec(torch.optim.AdamW, {"lr": lr}), info)


def make_workload(name: str, tiny: bool = False, batch: int | None = None, seed: int = 0) -> Workload:
    """A workload by benchmark name (raises llama.Unavailable when transformers is missing)."""
    if name == "llama":
        return llama_workload(tiny=tiny, batch=batch, seed=seed)
    if name == "lora7b":
        return lora_workload(tiny=tiny, batch=batch, seed=seed)
    if name == "mixtral":
        return mixtral_workload(tiny=tiny, batch=batch, seed=seed)
    return gpt_workload(name, tiny=tiny, batch=batch, seed=seed)
