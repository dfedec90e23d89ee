"""The tiny Llama the decoder tests share, and the prompts and transformers references they check
against: one definition, so that the numpy suites and the transformers oracle suites test the same
model (hidden 64, 2 layers, 4 heads on 2 KV heads, vocab 256).

torch and transformers are imported inside the functions that need them, so the numpy suites
import this module without them.
"""
from __future__ import annotations

import numpy as np

from pagedkv.model import LlamaDims

PAD = 0
DIMS = LlamaDims(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=500.0)


def prompts_of(lengths, seed=0) -> list[list[int]]:
    """Seeded random prompts of these lengths (token ids 1..255: 0 is the padding id)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, n).tolist() for n in lengths]


def tiny_llama(rope_theta: float = 500.0, seed: int = 0, **overrides):
    """A seeded random LlamaForCausalLM of :data:`DIMS`' shape (``overrides`` change its config)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    overrides.setdefault("num_key_value_heads", 2)
    cfg = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=256, intermediate_size=128, max_position_embeddings=512, rope_theta=rope_theta,
        initializer_range=0.1, pad_token_id=PAD, bos_token_id=None, eos_token_id=None, **overrides)
    return transformers.LlamaForCausalLM(cfg).eval()


def hf_greedy(hf, prompts, new_tokens):
    """transformers' own batched greedy generate with its own cache (left padding and an
    attention mask): tokens ``[batch, new]`` and logits ``[batch, new, vocab]`` as numpy."""
    import torch

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                      do_sample=False, output_logits=True, return_dict_in_generate=True,
                      pad_token_id=PAD, eos_token_id=None)
    return out.sequences[:, width:].numpy(), torch.stack(out.logits, dim=1).numpy()
