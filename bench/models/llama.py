"""A Llama-architecture workload from Hugging Face's LlamaConfig, random weights (nothing is downloaded).

The benchmark size follows TinyLlama-1.1B's shape (hidden 2048, MLP 5632, 22 layers,
32 heads with 4 key/value heads, vocab 32000), sequence 1024, batch 8. Needs
``transformers``; without it ``llama_workload`` raises ``Unavailable`` and the
suite records the model as "not installed".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..peers.common import OptimizerSpec, Workload, parameter_count

BENCH = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
             "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048}
TINY = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 64}
SEQ, BATCH, TINY_SEQ, TINY_BATCH = 1024, 8, 32, 4
# Llama-2-7B's sizes (the TURNIP paper's LoRA and prefill experiments); random weights
LLAMA2_7B = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768}
# the paper's LoRA: rank 16 on the attention projections and the feed-forward matrices
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK = 16


class Unavailable(RuntimeError):
    """The workload cannot be built here (a package is missing)."""


def llama_loss(model, batch) -> torch.Tensor:
    """Next-token cross-entropy on the logits, forward under bf16 autocast (same recipe as the GPTs)."""
    idx, targets = batch
    with torch.autocast(idx.device.type, dtype=torch.bfloat16):
        logits = model(input_ids=idx, use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _llama(shape: dict, seed: int):
    """A LlamaForCausalLM of ``shape`` with seeded random weights (transformers imported by the caller)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, rms_norm_eps=1e-5, tie_word_embeddings=False, use_cache=False,
                      attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _next_token_batch(vocab: int, size: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (size, seq + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def llama_workload(tiny: bool = False, batch: int | None = None, seed: int = 0, lr: float = 1e-4) -> Workload:
    try:
        import transformers  # noqa: F401 - only whether it is there
    except ImportError as exc:
        raise Unavailable(f"transformers is not installed ({exc})") from None
    shape = TINY if tiny else BENCH
    model = _llama(shape, seed)
    model.train()
    seq, size = (TINY_SEQ, batch or TINY_BATCH) if tiny else (SEQ, batch or BATCH)
    data = _next_token_batch(shape["vocab_size"], size, seq, seed)
    info = {"config": dict(shape), "batch_size": size, "seq": seq, "loss": "bf16 autocast, fp32 cross-entropy",
            **parameter_count(model)}
    return Workload("llama" + ("-tiny" if tiny else ""), model, llama_loss, data,
                    OptimizerSpec(torch.optim.AdamW, {"lr": lr}), info)


def lora_workload(tiny: bool = False, batch: int | None = None, seq: int | None = None, seed: int = 0,
                  lr: float = 1e-4, rank: int = LORA_RANK) -> Workload:
    """LoRA fine-tuning of a Llama-2-7B-shaped model (peft, ``rank`` on LORA_TARGETS, base weights fp32
    and frozen, AdamW on the adapters), batch x seq tokens (default 8 x 1024); ``tiny``: 2 layers.
    The 7B base is 27 GB of fp32 weights in host memory (a copy per system that runs)."""
    try:
        import peft
    except ImportError as exc:
        raise Unavailable(f"transformers and peft are needed ({exc})") from None
    shape = TINY if tiny else LLAMA2_7B
    lora = peft.LoraConfig(r=min(rank, 4) if tiny else rank, lora_alpha=2 * rank, lora_dropout=0.0,
                           target_modules=list(LORA_TARGETS))
    model = peft.get_peft_model(_llama(shape, seed), lora)
    model.train()
    seq = seq or (TINY_SEQ if tiny else SEQ)
    size = batch or (TINY_BATCH if tiny else BATCH)
    data = _next_token_batch(shape["vocab_size"], size, seq, seed)
    info = {"config": dict(shape), "batch_size": size, "seq": seq, "lora_rank": lora.r,
            "lora_targets": list(LORA_TARGETS), "loss": "bf16 autocast, fp32 cross-entropy", **parameter_count(model)}
    return Workload("lora7b" + ("-tiny" if tiny else ""), model, llama_loss, data,
                    OptimizerSpec(torch.optim.AdamW, {"lr": lr}), info)
