"""``pagedkv size``: KV bytes per token and per block of a model, and how many tokens fit.

Examples:

    pagedkv size --list
    pagedkv size Llama-3.1-8B --gpu-mem-gib 80 --util 0.9          # weights estimated: 14.96 GiB
    pagedkv size OPT-13B --kv-gib 12                                # vLLM Table 1: 15,728 slots
    pagedkv size --config path/to/config.json --dtype fp8 --tp 4
    pagedkv size gpt-oss-20b --kv-gib 40 --context 4096,131072    # hybrid: per-group sizes
    pagedkv size Qwen3-Next-80B-A3B --tp 4 --kv-gib 34.28 --replay mooncake   # recurrent states
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..sim.sizing import (
    GIB,
    MAX_MEMORY_GIB,
    ModelSpec,
    attention_groups,
    builtin_models,
    estimate_weight_bytes,
    fit_blocks,
    get_model,
    group_kv,
    kv_budget_bytes,
    load_config,
    kv_size,
    request_kv_bytes,
    spec_from_config,
)
from ..sim.page_layout import equal_page_layout, vllm_group_layers
from ..sim.state_sizing import get_hybrid, hybrid_from_config, is_hybrid_state_config
from .size_hybrid import REPLAY_TRACES, hybrid_tables, list_table as hybrid_list_table
from ..report.tables import Table
from . import UsageError, attention_name, check_int, check_number, emit, reports_errors

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``size`` subcommand's options on ``parser``."""
    parser.add_argument("model", nargs="?", help="built-in model name (see --list)")
    parser.add_argument("--config", metavar="PATH", help="a Hugging Face config.json instead of a name")
    parser.add_argument("--dtype", help="KV cache dtype (default: the model's torch_dtype), e.g. fp8")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument("--gpu-mem-gib", type=float, help="memory of one GPU in GiB, e.g. 80")
    parser.add_argument("--util", type=float, default=0.9,
                        help="fraction of GPU memory for weights + KV (default 0.9, as vLLM)")
    parser.add_argument("--weights-gib", type=float,
                        help="weights per GPU in GiB (default: estimated for dense models)")
    parser.add_argument("--kv-gib", type=float, help="a KV budget per GPU in GiB, instead of --gpu-mem-gib")
    parser.add_argument("--list", action="store_true", help="list the built-in models and their KV sizes")
    parser.add_argument("--context", default=",".join(map(str, DEFAULT_CONTEXTS)), metavar="N[,N...]",
                        help="context lengths (tokens) at which a hybrid model's KV per request is shown "
                             "uniform against grouped (default %(default)s)")
    parser.add_argument("--replay", default="", metavar="TRACE[,TRACE...]",
                        help="recurrent-state hybrids: replay these lengths through vLLM's pages, separate "
                             f"pools and small pages ({', '.join(REPLAY_TRACES)}; needs a KV budget)")
    parser.add_argument("--requests", type=int, default=1000,
                        help="requests of each --replay trace (the first N; default %(default)s)")
    parser.add_argument("--max-running", type=int, default=1024,
                        help="most requests running at once in a --replay (default %(default)s, vLLM's "
                             "--max-num-seqs on GPUs of 70 GiB or more)")


DEFAULT_CONTEXTS = (4096, 8192, 32768, 131072)
MAX_CONTEXT = 1 << 24  # 16M tokens: longer than any model's context


def _contexts(text: str) -> list[int]:
    """``--context 4096,131072`` -> [4096, 131072], or a UsageError naming the flag."""
    out = []
    for part in str(text).split(","):
        try:
            n = int(part.strip().replace("_", ""))
        except ValueError:
            raise UsageError(f"--context must be comma-separated token counts, got {text!r}") from None
        check_int("--context", n, 1, MAX_CONTEXT)
        out.append(n)
    return out


def _check(args: argparse.Namespace) -> None:
    """Every flag, by the name the user typed, before anything is computed."""
    if not args.list:
        if not args.model and not args.config:
            raise UsageError("give a model name or --config PATH (or --list)")
        if args.model and args.config:
            raise UsageError("give a model name or --config, not both")
    check_int("--tp", args.tp, 1, 4096)
    check_int("--block-size", args.block_size, 1, 1 << 20)
    for flag, value in (("--gpu-mem-gib", args.gpu_mem_gib), ("--kv-gib", args.kv_gib)):
        if value is not None:
            check_number(flag, value, hi=MAX_MEMORY_GIB, why=" (1 PiB)")
    if args.weights_gib is not None:
        check_number("--weights-gib", args.weights_gib, lo_open=False, hi=MAX_MEMORY_GIB, why=" (1 PiB)")
    check_number("--util", args.util, hi=1.0)
    if args.kv_gib is not None and args.gpu_mem_gib is not None:
        raise UsageError("give --kv-gib or --gpu-mem-gib, not both")
    args.contexts = _contexts(args.context)
    check_int("--requests", args.requests, 1, 1 << 20)
    check_int("--max-running", args.max_running, 1, 1 << 20)
    args.replay = [t.strip() for t in str(args.replay).split(",") if t.strip()]
    for trace in args.replay:
        if trace not in REPLAY_TRACES:
            raise UsageError(f"--replay must name traces among {', '.join(REPLAY_TRACES)}, got {trace!r}")


def _tp_misfit(spec: ModelSpec, tp: int) -> bool:
    """True when ``tp`` GPUs cannot share the KV heads evenly: ``tp`` neither divides the heads
    nor is a multiple of them (each GPU would hold ``ceil(heads / tp)``, some of them idle)."""
    return not spec.is_mla and spec.num_kv_heads % tp != 0 and tp % spec.num_kv_heads != 0


def _check_tp(spec: ModelSpec, tp: int) -> None:
    if _tp_misfit(spec, tp):
        h = spec.num_kv_heads
        divisors = [d for d in range(1, h + 1) if h % d == 0]
        raise UsageError(f"--tp {tp} does not divide {spec.name}'s {h} KV heads (nor is it a multiple "
                         f"of {h}): the heads cannot be split evenly; use {', '.join(map(str, divisors))} "
                         f"or a multiple of {h}")


def _list_table(args: argparse.Namespace) -> Table:
    t = Table(f"Built-in models (KV per GPU at tp={args.tp}, block size {args.block_size})",
              ["model", "attention", "layers", "kv heads/GPU", "head dim", "dtype",
               "bytes/token", "KiB/token", "bytes/block"])
    misfits = []
    for spec in builtin_models().values():
        if _tp_misfit(spec, args.tp):
            misfits.append(spec.name)
        s = kv_size(spec, dtype=args.dtype, tp=args.tp, block_size=args.block_size)
        heads = "latent" if spec.is_mla else s.kv_heads_per_gpu
        dim = f"{spec.kv_lora_rank}+{spec.qk_rope_head_dim}" if spec.is_mla else spec.head_dim
        t.add(spec.name, s.attention, spec.num_layers, heads, dim, s.dtype,
              s.bytes_per_token, s.bytes_per_token / 1024, s.bytes_per_block)
    t.notes.append("bytes/token = 2 x layers x kv_heads x head_dim x dtype bytes "
                   "(MLA: layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes)")
    hybrid = [f"{spec.name} ({_layer_mix(spec)})" for spec in builtin_models().values() if spec.is_hybrid]
    if hybrid:
        t.notes.append("hybrid models, whose rows count every layer as a uniform allocator does: "
                       f"{'; '.join(hybrid)}; their grouped sizes: pagedkv size MODEL")
    if misfits:
        t.notes.append(f"tp={args.tp} does not divide the KV heads of {', '.join(misfits)}: their rows "
                       f"round up to ceil(kv_heads / {args.tp}) heads per GPU, a split no engine makes")
    return t


def _layer_mix(spec: ModelSpec) -> str:
    """"12 sliding window 128 + 12 full" for a hybrid model, "32 full" for a uniform one."""
    return " + ".join(f"{n} {attention_name(a)}" for a, n in attention_groups(spec))


def _hybrid_tables(args: argparse.Namespace, spec: ModelSpec, budget: int | None) -> list[Table]:
    """A hybrid model's groups, and its KV per request at each ``--context`` length, uniform
    (every layer keeps every block) against grouped (each group only the blocks it reads)."""
    kw = dict(dtype=args.dtype, tp=args.tp, block_size=args.block_size)
    groups = Table(f"Attention groups: {spec.name} (per GPU, block size {args.block_size})",
                   ["group", "attention", "layers", "bytes/token", "bytes/block"])
    for i, g in enumerate(group_kv(spec, 0, **kw)):
        groups.add(i, attention_name(g.attention), g.layers, g.bytes_per_token, g.bytes_per_block)
    cols = ["context tokens", "uniform MiB", "grouped MiB", "saved %"]
    pages = None
    if budget is not None:
        cols += ["requests fit, uniform", "requests fit, grouped", "requests fit, vLLM pages"]
        pages = equal_page_layout(spec, budget, **kw)
    per_request = Table(f"KV of one request: uniform against grouped ({spec.name})", cols)
    for n in args.contexts:
        uniform = request_kv_bytes(spec, n, grouped=False, **kw)
        grouped = request_kv_bytes(spec, n, **kw)
        row = [n, f"{uniform / 2**20:,.1f}", f"{grouped / 2**20:,.1f}", f"{100 * (1 - grouped / uniform):.1f}"]
        if budget is not None:
            row += [budget // uniform, budget // grouped, pages.requests_fit(n)]
        per_request.add(*row)
    per_request.notes.append(
        "grouped: a sliding-window group holds the blocks its last position read (window W: "
        "about W / block size + 1 blocks), a chunked-local group the blocks of the current chunk, "
        "a full group every block; uniform: every layer keeps every block")
    if budget is not None:
        per_request.notes.append("requests fit = KV budget // bytes per request, each group's blocks "
                                 "sized for its own layers (no page-size padding)")
        g = vllm_group_layers(spec)
        per_request.notes.append(
            f"vLLM pages: one pool of equal pages of {g} layers (vLLM's KV cache groups), "
            f"{pages.num_tables} block tables per request, {pages.padding_layers} padding layer slots"
            + (f" ({100 * pages.padding_layers / spec.num_layers:.1f}% of the layers)" if pages.padding_layers else "")
            + "; the report's hybrid section compares it with separate pools")
    return [groups, per_request]


def _size_tables(args: argparse.Namespace) -> list[Table]:
    if args.config and Path(args.config).is_dir():
        raise UsageError(f"--config {args.config} is a directory; give the config.json file in it")
    if args.config and not Path(args.config).is_file():
        raise UsageError(f"--config {args.config}: no such file")
    config = load_config(args.config) if args.config else None
    hybrid = (hybrid_from_config(config, name=Path(args.config).parent.name or None)
              if config is not None and is_hybrid_state_config(config)
              else get_hybrid(args.model) if args.model else None)
    if hybrid is not None:
        return hybrid_tables(hybrid, args, _hybrid_budget(args))
    if args.replay:
        raise UsageError("--replay sizes recurrent-state hybrids; this model has no recurrent state")
    spec = spec_from_config(args.config) if args.config else get_model(args.model)
    _check_tp(spec, args.tp)
    s = kv_size(spec, dtype=args.dtype, tp=args.tp, block_size=args.block_size)
    t = Table(f"KV cache size: {spec.name}", ["quantity", "value"])
    t.add("attention", s.attention)
    t.add("layers", spec.num_layers)
    if spec.is_mla:
        t.add("latent per layer (kv_lora_rank + qk_rope_head_dim)", s.elems_per_token_layer)
    else:
        t.add("KV heads (total)", spec.num_kv_heads)
        t.add(f"KV heads per GPU (tp={args.tp})", s.kv_heads_per_gpu)
        t.add("head dim", spec.head_dim)
    t.add("dtype", s.dtype)
    t.add("bytes per token per GPU", s.bytes_per_token)
    t.add("bytes per token, all GPUs", s.bytes_per_token_total)
    t.add(f"bytes per block ({args.block_size} tokens)", s.bytes_per_block)
    t.add("token slots per GiB of KV", GIB // s.bytes_per_token)
    tables = [t]
    if spec.is_hybrid:
        t.notes.append(f"hybrid: {_layer_mix(spec)} layers; the bytes above count every layer "
                       "(a uniform allocator), the tables below each group")
    cap = _capacity_table(args, spec, s)
    if cap is not None:
        tables.append(cap)
    if spec.is_hybrid:
        tables += _hybrid_tables(args, spec, _budget(args, spec))
    return tables


def _hybrid_budget(args: argparse.Namespace) -> int | None:
    """A recurrent-state hybrid's KV budget: --kv-gib, or --gpu-mem-gib with --weights-gib (their
    weights are never estimated: every built-in hybrid is a mixture of experts or MLA)."""
    if args.kv_gib is not None:
        return int(args.kv_gib * GIB)
    if args.gpu_mem_gib is None:
        if args.replay:
            raise UsageError("--replay needs a KV budget: give --kv-gib, or --gpu-mem-gib with --weights-gib")
        return None
    if args.weights_gib is None:
        raise UsageError("--gpu-mem-gib needs --weights-gib for a recurrent-state hybrid (its weights are not "
                         "estimated)")
    return kv_budget_bytes(args.gpu_mem_gib, args.util, args.weights_gib)


def _budget(args: argparse.Namespace, spec: ModelSpec) -> int | None:
    """The KV budget in bytes the capacity table used (None when no memory was given)."""
    if args.kv_gib is not None:
        return int(args.kv_gib * GIB)
    if args.gpu_mem_gib is None:
        return None
    weights = args.weights_gib
    if weights is None:
        weights = estimate_weight_bytes(spec, tp=args.tp) / GIB
    return fit_blocks(kv_size(spec, tp=args.tp), gpu_mem_gib=args.gpu_mem_gib, util=args.util,
                      weights_gib=weights).kv_budget_bytes


def _capacity_table(args: argparse.Namespace, spec, s) -> Table | None:
    if args.kv_gib is None and args.gpu_mem_gib is None:
        return None
    t = Table("What fits (per GPU)", ["quantity", "value"])
    if args.kv_gib is not None:
        cap = fit_blocks(s, kv_budget_gib=args.kv_gib)
    else:
        weights = args.weights_gib
        if weights is None:
            est = estimate_weight_bytes(spec, tp=args.tp)
            if est is None:
                raise ValueError(f"cannot estimate weights of {spec.name} (MoE/MLA or missing fields): "
                                 "give --weights-gib")
            weights = est / GIB
            t.notes.append("weights estimated from the config (embeddings + attention + MLP matrices)")
        cap = fit_blocks(s, gpu_mem_gib=args.gpu_mem_gib, util=args.util, weights_gib=weights)
        t.add("GPU memory (GiB)", float(args.gpu_mem_gib))
        t.add("utilisation", float(args.util))
        t.add("weights (GiB)", float(weights))
    if cap.num_blocks < 1:
        flag = f"--kv-gib {args.kv_gib:g}" if args.kv_gib is not None else f"--gpu-mem-gib {args.gpu_mem_gib:g}"
        raise UsageError(f"{flag} leaves {cap.kv_budget_bytes:,.0f} bytes of KV budget: not one block "
                         f"({s.bytes_per_block:,} bytes of {spec.name} KV at block size {args.block_size})")
    t.add("KV budget (GiB)", cap.kv_budget_bytes / GIB)
    t.add("blocks", cap.num_blocks)
    t.add("token slots", cap.token_slots)
    t.notes.append("budget = GPU memory x utilisation - weights; GiB = 2**30 bytes")
    return t


@reports_errors("size")
def run(args: argparse.Namespace) -> int:
    """Print the requested tables; return 0, or 2 with one line on stderr for bad input."""
    _check(args)
    if args.list:
        emit(_list_table(args).to_text() + "\n\n" + hybrid_list_table(args.tp).to_text())
        return 0
    emit("\n\n".join(t.to_text() for t in _size_tables(args)))
    return 0
