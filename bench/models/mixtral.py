"""A Mixtral-architecture workload from Hugging Face's MixtralConfig, random weights (nothing is downloaded).

The benchmark size is about 0.93B parameters: hidden 1024, 12 layers, 8 experts of MLP width
2816 with 2 chosen per token, 16 heads with 8 key/value heads, vocab 32000; sequence 1024,
batch 8. The experts run with the installed transformers' default implementation
(``grouped_mm``), the forward under bf16 autocast like the other workloads. Needs
``transformers``; without it ``mixtral_workload`` raises ``Unavailable``.
"""

from __future__ import annotations

import torch

from ..peers.common import OptimizerSpec, Workload, parameter_count
from .llama import BATCH, SEQ, TINY_BATCH, TINY_SEQ, Unavailable, _next_token_batch, llama_loss

BENCH = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12,
         "num_attention_heads": 16, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
         "max_position_embeddings": 2048}
# intermediate 48 keeps each expert's rows 16-byte aligned for the CPU's grouped_mm kernel
TINY = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
        "max_position_embeddings": 64}


def mixtral_workload(tiny: bool = False, batch: int | None = None, seed: int = 0, lr: float = 1e-4) -> Workload:
    try:
        from transformers import MixtralConfig, MixtralForCausalLM
    except ImportError as exc:
        raise Unavailable(f"transformers with Mixtral is needed ({exc})") from None
    shape = TINY if tiny else BENCH
    cfg = MixtralConfig(**shape, rms_norm_eps=1e-5, tie_word_embeddings=False, use_cache=False,
                        attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = MixtralForCausalLM(cfg).train()
    seq, size = (TINY_SEQ, batch or TINY_BATCH) if tiny else (SEQ, batch or BATCH)
    data = _next_token_batch(shape["vocab_size"], size, seq, seed)
    info = {"config": dict(shape), "batch_size": size, "seq": seq, "loss": "bf16 autocast, fp32 cross-entropy",
            "experts_implementation": model.config._experts_implementation,
            **parameter_count(model)}
    return Workload("mixtral" + ("-tiny" if tiny else ""), model, llama_loss, data,
                    OptimizerSpec(torch.optim.AdamW, {"lr": lr}), info)
