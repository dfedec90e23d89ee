"""``pagedkv size``: KV bytes per token and per block of a model, and how many tokens fit.

Examples:

    pagedkv size --list
    pagedkv size Llama-3.1-8B --gpu-mem-gib 80 --util 0.9          # weights estimated: 14.96 GiB
    pagedkv size OPT-13B --kv-gib 12                                # vLLM Table 1: 15,728 slots
    pagedkv size --config path/to/config.json --dtype fp8 --tp 4
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..sim.sizing import (
    GIB,
    MAX_MEMORY_GIB,
    ModelSpec,
    builtin_models,
    estimate_weight_bytes,
    fit_blocks,
    get_model,
    kv_size,
    spec_from_config,
)
from ..tables import Table
from . import UsageError, check_int, check_number, emit, reports_errors

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
    if misfits:
        t.notes.append(f"tp={args.tp} does not divide the KV heads of {', '.join(misfits)}: their rows "
                       f"round up to ceil(kv_heads / {args.tp}) heads per GPU, a split no engine makes")
    return t


def _size_tables(args: argparse.Namespace) -> list[Table]:
    if args.config and Path(args.config).is_dir():
        raise UsageError(f"--config {args.config} is a directory; give the config.json file in it")
    if args.config and not Path(args.config).is_file():
        raise UsageError(f"--config {args.config}: no such file")
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
    cap = _capacity_table(args, spec, s)
    if cap is not None:
        tables.append(cap)
    return tables


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
        emit(_list_table(args).to_text())
        return 0
    emit("\n\n".join(t.to_text() for t in _size_tables(args)))
    return 0
