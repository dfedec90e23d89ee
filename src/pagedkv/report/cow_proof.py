"""Report section: copy-on-write measured on a real decoder, against transformers.

A tiny, seeded, randomly initialised Llama (transformers' ``LlamaForCausalLM``) runs through the
reference engine with its K/V in the paged store. Parallel sampling (n = 4) forks the prompt;
every sample's logits at every step are compared with a cache-free transformers forward over that
sample's tokens. With copy-on-write the largest difference is float noise (~1e-6). With the
engine overriding the copies, so that each child writes its first token in place into the shared
partial block (an allocator without CoW), three of four samples read a sibling's K/V and their
logits move by O(1).

The bytes column pair is the other half of the argument: copying lazily moves one partial block
per child that writes into it, eager copying at fork would move the parent's whole table per
child. Worked number (block size 16, the section's 41-token prompt, n = 4): lazy 3 blocks, eager 3 × 3 = 9; at
Llama-3.1-8B's 2 MiB per block that is 6 MiB against 18 MiB, and the gap grows with the prompt.
"""
from __future__ import annotations

import importlib.util

import numpy as np

from ..tables import Section, Table
from .options import ReportOptions

KEY, HEADING = "cow_proof", "Copy-on-write, proven on a real decoder"
N, BEAMS, DIVERGED = 4, 4, 1e-3  # samples, beam width, |logit error| that counts as diverged


def _missing() -> str | None:
    """The optional packages this section needs that are not importable (None when all are)."""
    absent = []
    for name in ("torch", "transformers"):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a module blocked in sys.modules has no spec
            found = False
        if not found:
            absent.append(name)
    return ", ".join(absent) or None


def _tiny_llama(seed: int):
    """Seeded random Llama: hidden 64, 2 layers, 4 heads on 2 KV heads, vocab 256 (no download)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, intermediate_size=128, max_position_embeddings=512, rope_theta=500.0,
        initializer_range=0.1, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    return transformers.LlamaForCausalLM(cfg).eval()


def _one_thread(fn):
    """Run ``fn`` with one torch intra-op thread (restored after): at this model size a second
    thread only spin-waits, and on a busy 2-core machine it made runs ~10x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _errors(hf, prompt: list[int], samples) -> list[float]:
    """Per sample: largest |engine logits - transformers logits| over all steps."""
    import torch

    out = []
    for s in samples:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + s.tokens[:-1]]), use_cache=False).logits[0, len(prompt) - 1:]
        out.append(float(np.abs(np.stack(s.logits) - ref.numpy()).max()))
    return out


def _run(hf, model, prompt, bs, steps, seed, **how):
    from ..engine import Engine
    from ..manager import KVCacheManager

    cow = how.pop("copy_on_write", True)
    engine = Engine(model, KVCacheManager(64 + 8 * steps, bs), copy_on_write=cow)
    (res,) = engine.generate([prompt], steps, seed=seed, **how)
    return _errors(hf, prompt, res.samples), engine.stats


def section(opts: ReportOptions) -> Section:
    missing = _missing()
    if missing:
        return Section(KEY, HEADING, intro=f"Skipped: this section needs {missing} "
                       "(pip install 'pagedkv[model]').", data={"skipped": f"missing {missing}"})
    from ..model import PagedLlama
    from ..sim.sizing import kv_bytes_per_token
    from ..store import kv_bytes_per_block

    bs, steps = opts.block_size, (8 if opts.quick else 32)
    hf = _tiny_llama(opts.seed)
    model = PagedLlama.from_transformers(hf)
    prompt_len = 2 * bs + bs // 2 + 1 if bs > 1 else 5  # two full blocks and a partial one
    prompt = np.random.default_rng(opts.seed).integers(1, 256, prompt_len).tolist()
    runs = [
        ("parallel sampling n=4, copy-on-write", dict(n=N, temperature=1.0)),
        ("same run, child writes in place (no CoW)", dict(n=N, temperature=1.0, copy_on_write=False)),
        ("beam search width 4, copy-on-write", dict(beam_width=BEAMS)),
    ]
    measured = _one_thread(lambda: [(name, *_run(hf, model, prompt, bs, steps, opts.seed, **how))
                                    for name, how in runs])
    model_block = kv_bytes_per_token(opts.model) * bs
    d = model.dims
    tiny_block = kv_bytes_per_block(d.num_layers, bs, d.num_kv_heads, d.head_dim)
    return Section(
        KEY, HEADING,
        intro=(f"A seeded random Llama (hidden 64, 2 layers, GQA 4/2) generates {steps} tokens per "
               f"sample from a {prompt_len}-token prompt with its K/V only in the paged store "
               f"(block size {bs}); every step's logits are compared with transformers run over the "
               "sample's full token sequence without a cache."),
        tables=[_error_table(measured, steps), _bytes_table(measured, tiny_block, model_block, opts.model)],
        data=_data(measured, model_block),
    )


def _error_table(measured, steps) -> Table:
    t = Table("logit error against transformers", ["run", "sequences", "steps", "max |Δ logit|",
                                                  f"sequences off by > {DIVERGED:g}"],
              plot={"x": "run", "y": ["max |Δ logit|"], "kind": "bar", "logy": True,
                    "ylabel": "largest logit error (log scale)"})
    for name, errs, _ in measured:
        t.add(name, len(errs), steps, max(errs), sum(e > DIVERGED for e in errs))
    t.notes.append("In place, the samples overwrite one another's K/V at the same offset of the shared "
                   "block; only the last writer still reads its own. With CoW the error is float noise.")
    return t


def _bytes_table(measured, tiny_block, model_block, model_name) -> Table:
    t = Table(f"bytes copied: lazily (CoW) vs eagerly at fork (right: {model_name}, "
              f"{model_block:,} B/block)",
              ["run", "forks", "CoW blocks", "eager blocks", "CoW bytes", "eager bytes",
               "CoW MiB", "eager MiB", "eager / CoW"],
              plot={"x": "run", "y": ["CoW MiB", "eager MiB"], "kind": "bar",
                    "ylabel": f"MiB moved ({model_name})"})
    for name, _, st in measured:
        if "in place" in name:
            continue
        t.add(name, st.forks, st.copied_blocks, st.eager_fork_blocks, st.copied_bytes,
              st.eager_fork_blocks * tiny_block, st.copied_blocks * model_block / 2**20,
              st.eager_fork_blocks * model_block / 2**20,
              st.eager_fork_blocks / st.copied_blocks if st.copied_blocks else float("nan"))
    t.notes.append("Bytes are the test model's (2 layers × 2 KV heads × 16 dims, float32); MiB columns "
                   "scale the same block counts to the report's model. Eager = the parent's whole "
                   "table copied at every fork.")
    return t


def _data(measured, model_block) -> dict:
    (_, cow, st), (_, in_place, _), (_, beam, beam_st) = measured
    return {
        "max_error_cow": max(cow),
        "max_error_in_place": max(in_place),
        "max_error_beam": max(beam),
        "diverged_in_place": sum(e > DIVERGED for e in in_place),
        "cow_blocks": st.copied_blocks,
        "eager_blocks": st.eager_fork_blocks,
        "cow_bytes": st.copied_bytes,
        "cow_bytes_model": st.copied_blocks * model_block,
        "eager_bytes_model": st.eager_fork_blocks * model_block,
        "beam_cow_blocks": beam_st.copied_blocks,
        "beam_eager_blocks": beam_st.eager_fork_blocks,
    }
