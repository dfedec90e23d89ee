"""Report section: copy-on-write measured on a real decoder, against a dense reference.

A tiny Llama with seeded random numpy weights runs through the reference engine with its K/V
only in the paged numpy store. Parallel sampling (n = 4) forks the prompt; every sample's logits
at every step are compared with the same model run densely over that sample's tokens (full
causal attention over the whole sequence: no store, no block tables, no copies). With
copy-on-write the largest difference is float noise (~1e-6). With the engine overriding the
copies, so that each child writes its first token in place into the shared partial block (an
allocator without CoW), three of four samples read a sibling's K/V and their logits move by O(1).
That the dense model is Llama's maths is checked against transformers' ``LlamaForCausalLM`` in
the test suite; this section needs numpy only.

The bytes column pair is the other half of the argument: copying lazily moves one partial block
per child that writes into it, eager copying at fork would move the parent's whole table per
child. Worked number (block size 16, the section's 41-token prompt, n = 4): lazy 3 blocks, eager
3 × 3 = 9; at Llama-3.1-8B's 2 MiB per block that is 6 MiB against 18 MiB, and the gap grows with
the prompt.
"""
from __future__ import annotations

import numpy as np

from .tables import Section, Table
from .options import ReportOptions

KEY, HEADING = "cow_proof", "Copy-on-write, proven on a real decoder"
N, BEAMS, DIVERGED = 4, 4, 1e-3  # samples, beam width, |logit error| that counts as diverged


def tiny_llama(seed: int):
    """Seeded random Llama: hidden 64, 2 layers, 4 heads on 2 KV heads, vocab 256, numpy weights."""
    from ..model import LlamaDims, PagedLlama

    dims = LlamaDims(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=500.0)
    return PagedLlama.random(dims, seed=seed)


def prompt_length(block_size: int) -> int:
    """Two full blocks and a partial one (41 tokens at block size 16), so that forks share a
    partially filled block; 5 tokens at block size 1, where every block is full."""
    return 2 * block_size + block_size // 2 + 1 if block_size > 1 else 5


def _errors(model, prompt: list[int], samples) -> list[float]:
    """Per sample: largest |paged logits - dense logits| over all steps."""
    out = []
    for s in samples:
        ref = model.dense_forward(prompt + s.tokens[:-1])[len(prompt) - 1:]
        out.append(float(np.abs(np.stack(s.logits) - ref).max()))
    return out


def _run(model, prompt, bs, steps, seed, **how):
    """One generation on a fresh manager: (per-sample errors, engine stats, the manager's CoW count)."""
    from ..engine import Engine
    from ..manager import KVCacheManager

    cow = how.pop("copy_on_write", True)
    engine = Engine(model, KVCacheManager(64 + 8 * steps, bs), copy_on_write=cow)
    (res,) = engine.generate([prompt], steps, seed=seed, **how)
    return _errors(model, prompt, res.samples), engine.stats, engine.manager.usage().cow_copies


def section(opts: ReportOptions) -> Section:
    from ..sim.sizing import kv_bytes_per_token
    from ..store import kv_bytes_per_block

    bs, steps = opts.block_size, (8 if opts.quick else 32)
    model = tiny_llama(opts.seed)
    prompt_len = prompt_length(bs)
    prompt = np.random.default_rng(opts.seed).integers(1, 256, prompt_len).tolist()
    runs = [
        ("parallel sampling n=4, copy-on-write", dict(n=N, temperature=1.0)),
        ("same run, child writes in place (no CoW)", dict(n=N, temperature=1.0, copy_on_write=False)),
        ("beam search width 4, copy-on-write", dict(beam_width=BEAMS)),
    ]
    measured = [(name, *_run(model, prompt, bs, steps, opts.seed, **how)) for name, how in runs]
    model_block = kv_bytes_per_token(opts.model) * bs
    d = model.dims
    tiny_block = kv_bytes_per_block(d.num_layers, bs, d.num_kv_heads, d.head_dim)
    return Section(
        KEY, HEADING,
        intro=(f"A seeded random Llama (numpy weights; hidden 64, 2 layers, GQA 4/2) generates "
               f"{steps} tokens per sample from a {prompt_len}-token prompt with its K/V only in the "
               f"paged store (block size {bs}); every step's logits are compared with the same model "
               "run densely over the sample's whole token sequence (causal attention, no paging). "
               "The test suite checks the dense model against transformers' LlamaForCausalLM."),
        tables=[_error_table(measured, steps), _bytes_table(measured, tiny_block, model_block, opts.model)],
        data=_data(measured, model_block),
    )


def _error_table(measured, steps) -> Table:
    t = Table("logit error against the dense reference",
              ["run", "sequences", "steps", "max |Δ logit|", f"sequences off by > {DIVERGED:g}"])
    for name, errs, _, _ in measured:
        t.add(name, len(errs), steps, max(errs), sum(e > DIVERGED for e in errs))
    t.notes.append("In place, the samples overwrite one another's K/V at the same offset of the shared "
                   "block; only the last writer still reads its own. With CoW the error is float noise.")
    return t


def _bytes_table(measured, tiny_block, model_block, model_name) -> Table:
    t = Table(f"bytes copied: lazily (CoW) vs eagerly at fork (MiB columns: {model_name}, "
              f"{model_block:,} B/block)",
              ["run", "forks", "CoW blocks", "eager blocks", "CoW bytes", "eager bytes",
               "CoW MiB", "eager MiB", "eager / CoW"],
              plot={"name": "cow_proof_bytes", "x": "run", "y": ["CoW MiB", "eager MiB"], "kind": "bar",
                    "annotate_values": True,
                    "legend": {"CoW MiB": "copy-on-write: blocks copied at first writes",
                               "eager MiB": "eager: the parent's whole table copied at every fork"},
                    "ylabel": f"MiB of {model_name} KV copied", "xlabel": "run",
                    "title": f"KV copied per run: copy-on-write against an eager copy at every fork "
                             f"({model_name}, {model_block / 2**20:g} MiB per block)"})
    for name, _, st, _ in measured:
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
    (_, cow, st, manager_cow), (_, in_place, _, _), (_, beam, beam_st, beam_manager_cow) = measured
    return {
        "max_error_cow": max(cow),
        "max_error_in_place": max(in_place),
        "max_error_beam": max(beam),
        "diverged_in_place": sum(e > DIVERGED for e in in_place),
        "cow_blocks": st.copied_blocks,
        "manager_cow_copies": manager_cow,
        "eager_blocks": st.eager_fork_blocks,
        "cow_bytes": st.copied_bytes,
        "cow_bytes_model": st.copied_blocks * model_block,
        "eager_bytes_model": st.eager_fork_blocks * model_block,
        "beam_cow_blocks": beam_st.copied_blocks,
        "beam_manager_cow_copies": beam_manager_cow,
        "beam_eager_blocks": beam_st.eager_fork_blocks,
    }
