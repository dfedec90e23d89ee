"""``pagedkv size`` for recurrent-state hybrids: state bytes, vLLM's forced block size, what fits.

Examples:

    pagedkv size Qwen3-Next-80B-A3B                          # state and attention bytes, block 544
    pagedkv size Qwen3-Next-80B-A3B --tp 4 --gpu-mem-gib 80 --weights-gib 37.72 --context 4096,32768
    pagedkv size Qwen3-Next-80B-A3B --tp 4 --gpu-mem-gib 80 --weights-gib 37.72 --replay mooncake

What it may import: ``pagedkv.sim`` and ``pagedkv.report.tables``; only ``commands.size`` calls it.
"""
from __future__ import annotations

import argparse

import numpy as np

from ..report.tables import Table
from ..sim.sizing import GIB
from ..sim.state_layout import compare_state_layouts
from ..sim.state_sizing import HybridModel, builtin_hybrids, hybrid_sizing, vllm_kernel_alignment
from ..sim.traces import trace_lengths, trace_not_found, trace_path
from ..sim.workloads import sample_lengths
from . import UsageError

__all__ = ["REPLAY_TRACES", "list_table", "hybrid_tables", "check_hybrid_tp"]

MIB = 1 << 20
REPLAY_TRACES = ("mooncake", "azure-conv", "sharegpt")
SHAREGPT_SEED = 0  # the ShareGPT-like lengths are drawn with this seed, so a replay is repeatable


def _kind(model: HybridModel) -> str:
    return {"gated_deltanet": "gated DeltaNet", "mamba2": "Mamba2", "mamba1": "Mamba",
            "kda": "Kimi Delta Attention"}[model.state.kind]


def list_table(tp: int) -> Table:
    """The built-in recurrent-state hybrids, one row each, at ``tp``."""
    t = Table(f"Built-in recurrent-state hybrids (per GPU at tp={tp}, bf16 K/V)",
              ["model", "attention layers", "state layers", "state", "K/V bytes/token/layer",
               "state bytes/layer", "vLLM block"])
    for model in builtin_hybrids().values():
        try:
            s = hybrid_sizing(model, tp=tp)
            t.add(model.name, model.attention_layers, model.state_layers, _kind(model),
                  s.attention_bytes_per_token_layer, s.state_bytes_per_layer, s.vllm_block_size)
        except ValueError:
            t.add(model.name, model.attention_layers, model.state_layers, _kind(model), "-", "-", "-")
    t.notes.append("vLLM block: the attention block size vLLM forces so that one layer's attention "
                   "page holds one layer's state; pagedkv size MODEL shows the rest")
    t.notes.append("'-': tp does not divide the model's state dimensions")
    return t


def check_hybrid_tp(model: HybridModel, tp: int) -> None:
    """KV heads that ``tp`` GPUs cannot share evenly, or state dimensions it does not divide."""
    h = model.num_kv_heads
    if not model.is_mla and h % tp and tp % h:
        raise UsageError(f"--tp {tp} does not divide {model.name}'s {h} KV heads (nor is it a multiple of {h})")
    try:
        model.state.shapes(tp)
    except ValueError as e:
        raise UsageError(f"--tp {tp}: {e}") from None


def _model_table(model: HybridModel, args: argparse.Namespace) -> Table:
    s = hybrid_sizing(model, tp=args.tp, dtype=args.dtype, block_size=args.block_size)
    conv, temporal = model.state.shapes(args.tp)
    t = Table(f"Recurrent-state hybrid: {model.name} (per GPU, tp={args.tp})", ["quantity", "value"])
    t.add("attention layers", model.attention_layers)
    t.add("state layers", f"{model.state_layers} {_kind(model)}")
    if model.is_mla:
        t.add("attention", f"MLA latent {model.kv_lora_rank} + {model.qk_rope_head_dim}")
    else:
        t.add("attention", f"{model.kv_heads_per_gpu(args.tp)} of {model.num_kv_heads} KV heads x {model.head_dim}")
    t.add("K/V bytes per token, one layer", s.attention_bytes_per_token_layer)
    t.add("K/V bytes per token, all attention layers", s.attention_bytes_per_token)
    t.add(f"conv state {conv} {model.state.conv_dtype}", s.conv_bytes_per_layer)
    t.add(f"temporal state {temporal} {model.state.temporal_dtype}", s.temporal_bytes_per_layer)
    t.add("state bytes per layer", s.state_bytes_per_layer)
    t.add("state bytes per sequence", s.state_bytes_per_sequence)
    t.add("state per sequence, in tokens of K/V", round(s.state_bytes_per_sequence / s.attention_bytes_per_token, 1))
    if model.source:
        t.notes.append(f"dimensions: {model.source}")
    t.notes.append("shapes as vLLM's MambaStateShapeCalculator builds them (mamba_utils.py); "
                   "--dtype changes the K/V dtype only")
    return t


def _vllm_table(model: HybridModel, args: argparse.Namespace) -> Table:
    s = hybrid_sizing(model, tp=args.tp, dtype=args.dtype, block_size=args.block_size)
    align = vllm_kernel_alignment(model)
    t = Table(f"vLLM's page rule: {model.name}", ["quantity", "value"])
    t.add("kernel alignment (tokens)", align)
    t.add("attention block size vLLM forces (tokens)", s.vllm_block_size)
    t.add("page bytes (one layer: block x K/V bytes per token)", s.vllm_page_bytes)
    t.add("state padding %", round(100 * s.vllm_state_padding, 2))
    t.add("layers per KV cache group", s.vllm_group_layers)
    t.add("groups: attention + state", f"{s.vllm_attention_groups} + {s.vllm_state_groups}")
    t.add("padding layer slots", s.vllm_padding_layers)
    for block in (s.vllm_block_size, args.block_size):
        t.add(f"empty slots per sequence at block {block}, (block - 1) / 2", s.fragmentation_slots(block))
        t.add(f"  in MiB (all attention layers)", round(s.fragmentation_bytes(block) / MIB, 3))
    t.notes.append(f"block = {max(align, args.block_size)} x ceil(state bytes / ({max(align, args.block_size)} x "
                   "K/V bytes per token)): vLLM's _align_hybrid_block_size (platforms/interface.py)")
    return t


def _fit_table(model: HybridModel, args: argparse.Namespace, budget: int) -> Table:
    s = hybrid_sizing(model, tp=args.tp, dtype=args.dtype, block_size=args.block_size)
    bs = args.block_size
    t = Table(f"Requests that fit in {budget / GIB:.2f} GiB of KV: {model.name} (per GPU, tp={args.tp})",
              ["context tokens", "vLLM pages", "small pages", "gain %", "vLLM MiB/req", "small MiB/req"])
    for n in args.contexts:
        vllm, small = s.vllm_requests_fit(budget, n), s.small_page_requests_fit(budget, n, bs)
        vllm_bytes = (s.vllm_attention_groups * -(-n // s.vllm_block_size) + s.vllm_state_groups) \
            * s.vllm_page_bytes * s.vllm_group_layers
        small_bytes = (-(-n // bs) + s.state_pages(bs)) * s.small_page_bytes(bs)
        gain = f"{100 * (small / vllm - 1):.1f}" if vllm else "-"
        t.add(n, vllm, small, gain, round(vllm_bytes / MIB, 2), round(small_bytes / MIB, 2))
    t.notes.append(f"vLLM pages: blocks of {s.vllm_block_size} tokens x {s.vllm_group_layers} layers; a request "
                   f"holds ceil(tokens / {s.vllm_block_size}) blocks per attention group and one per state group")
    t.notes.append(f"small pages (pagedkv's layout): pages of {bs} tokens of every attention layer; one state per "
                   f"sequence in {s.state_pages(bs)} pages of the same pool")
    t.notes.append("modelled: whole blocks only; vLLM's reserved null block and speculative state rows left out")
    return t


def _lengths(name: str, n: int, data_dir) -> tuple[np.ndarray, np.ndarray]:
    if name == "sharegpt":
        return sample_lengths("sharegpt", n, np.random.default_rng(SHAREGPT_SEED))
    path = trace_path(name, data_dir)
    if path is None:
        raise UsageError(f"--replay {name}: {trace_not_found(name, data_dir)}")
    prompts, outputs = trace_lengths(path)
    return np.array(prompts[:n]), np.array(outputs[:n])


def _replay_table(model: HybridModel, args: argparse.Namespace, budget: int, trace: str) -> Table:
    prompts, outputs = _lengths(trace, args.requests, getattr(args, "data_dir", None))
    t = Table(f"Layouts replayed, modelled: {model.name}, {len(prompts):,} {trace} requests, "
              f"{budget / GIB:.2f} GiB of KV per GPU (tp={args.tp})",
              ["layout", "mean running", "peak running", "never fit", "steps", "preemptions",
               "last-block waste %", "free while waiting %"])
    for row in compare_state_layouts(model, budget, prompts, outputs, tp=args.tp, block_size=args.block_size,
                                     max_running=args.max_running):
        r = row.result
        t.add(row.layout.name, round(r.mean_running, 2), r.peak_running, r.never_fit, r.steps,
              r.preemptions, round(100 * r.last_block_waste, 2), round(100 * r.free_while_waiting, 1))
    t.notes.append(f"modelled: requests queue at t = 0 (a saturated server), run first come first served, "
                   f"at most {args.max_running:,} at once; the newest is preempted when memory runs out")
    t.notes.append("last-block waste: empty token slots in the running requests' last attention blocks, "
                   "over every decode step; prefix hits are not modelled")
    return t


def hybrid_tables(model: HybridModel, args: argparse.Namespace, budget: int | None) -> list[Table]:
    """The tables ``pagedkv size`` prints for a recurrent-state hybrid."""
    check_hybrid_tp(model, args.tp)
    tables = [_model_table(model, args), _vllm_table(model, args)]
    if budget is not None:
        tables.append(_fit_table(model, args, budget))
        for trace in args.replay:
            tables.append(_replay_table(model, args, budget, trace))
    return tables
