"""The subcommands of ``pagedkv``: each module has ``add_arguments(parser)`` and ``run(args)``.

What they share is how bad input ends: one line on stderr, ``pagedkv CMD: error: ...``, naming
the flag as the user typed it, and exit status 2 (argparse's own code for usage errors), before
any work is done. :func:`reports_errors` turns a ``ValueError`` raised by ``run`` (a
:class:`UsageError` from the checks below, or a library ``ValueError`` such as a malformed trace)
into that line; the helpers below check the values the library would otherwise reject under its
own parameter names.

A write that fails after the checks passed (a full disk, an I/O error, ``/dev/full``) is not a
usage error: the work was done and its result could not be kept. It ends with one line, ``pagedkv
CMD: error: --json FILE: cannot write (No space left on device); nothing was written``, and exit
status 1 (:data:`WRITE_FAILED_EXIT`). Files are written whole or not at all
(:func:`write_text_atomically`: a temporary file in the same directory, renamed over the target
once complete), so a failed write never leaves a truncated JSON that reads as a finished run.

What it may import: everything below it (``pagedkv``, ``sim``, ``report``, ``bench``, ``events``);
only ``pagedkv.cli`` imports it.
"""
from __future__ import annotations

import functools
import math
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Callable

__all__ = [
    "UsageError",
    "reports_errors",
    "check_int",
    "check_number",
    "check_out_dir",
    "check_out_file",
    "check_data_dir",
    "check_model",
    "context_limit",
    "attention_name",
    "progress_bar",
    "check_requests_fit",
    "kv_memory",
    "grouped_kv_memory",
    "MAX_BLOCKS",
    "one_line",
    "OutputError",
    "write_text_atomically",
    "write_files_atomically",
    "emit",
    "WRITE_FAILED_EXIT",
]

# A command shows progress on a terminal's stderr unasked only once it has run this long: a
# shorter run prints nothing more than its result.
AUTO_PROGRESS_DELAY_S = 5.0
USAGE_EXIT = 2  # argparse's exit status for a usage error; every subcommand uses it
WRITE_FAILED_EXIT = 1  # the work ran, its output could not be written (disk full, I/O error)
# What one simulated replica can hold in memory and time on a laptop: the manager keeps about 8
# bytes per block before any sequence (16M blocks: ~130 MB; 1e6 GiB of Llama-3.1-8B KV would be
# 4 GB), and slot ids are int32.
MAX_BLOCKS = 1 << 24
MAX_SLOTS = (1 << 31) - 1


class UsageError(ValueError):
    """A command-line value the command cannot use; the message names the flag."""


class OutputError(Exception):
    """Writing a result failed after the work was done; the message names the file and the cause."""


def one_line(message: object) -> str:
    """``message`` as a single line (an error message must not spill over several)."""
    return " ".join(str(message).split())


def reports_errors(command: str) -> Callable:
    """Decorate ``run(args)``: a ``ValueError`` becomes one line on stderr and exit status 2."""
    def wrap(run: Callable) -> Callable:
        @functools.wraps(run)
        def guarded(args) -> int:
            try:
                return int(run(args) or 0)
            except ValueError as e:
                print(f"pagedkv {command}: error: {one_line(e)}", file=sys.stderr)
                return USAGE_EXIT
            except OutputError as e:
                print(f"pagedkv {command}: error: {one_line(e)}", file=sys.stderr)
                return WRITE_FAILED_EXIT
        return guarded
    return wrap


def emit(text: str) -> None:
    """Print ``text`` (and a newline) on stdout and flush it now, so that a stdout that cannot
    take it (``pagedkv report > /dev/full``) is an :class:`OutputError` here rather than an
    exception at the interpreter's exit. A closed pipe (``| head``) stays a ``BrokenPipeError``,
    which the command line treats as a normal end."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise OutputError(f"standard output: cannot write ({e.strerror or e})") from None


def _default_mode() -> int:
    """The mode ``open(path, "w")`` would give a new file: 0o666 less the umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_text_atomically(flag: str, path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all; an :class:`OutputError` naming ``flag``
    and ``path`` when the disk refuses.

    A regular file (or a new one) is written to a temporary file in its directory, flushed to
    disk and renamed over ``path``: a reader sees the old file or the complete new one, never a
    prefix, and a failure leaves the old file as it was. A path that is not a regular file (a
    device such as ``/dev/full``, a pipe, ``/dev/stdout``) cannot be replaced and is written in
    place. The rename keeps the old file's permission bits (a new one gets 0o666 less the umask).
    """
    target = Path(os.path.realpath(path))  # a symlink's target is what gets replaced, not the link
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OutputError(f"{flag} {path}: cannot write ({e.strerror or e})") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        try:
            with open(target, "w") as f:
                f.write(text)
        except OSError as e:
            raise OutputError(f"{flag} {path}: cannot write ({e.strerror or e})") from None
        return
    write_files_atomically(flag, target.parent, {target.name: text.encode()},
                           mode=stat.S_IMODE(st.st_mode) if st is not None else None, shown=path)


def write_files_atomically(flag: str, directory: Path, files: dict[str, bytes], *, mode: int | None = None,
                           shown: Path | None = None) -> list[Path]:
    """Write each ``name: content`` of ``files`` into ``directory``, every one to a temporary file
    first; rename them into place only once all are complete. A failure removes the temporary
    files and raises :class:`OutputError`: nothing new appears and no old file is touched.
    Returns the paths written, in the order given."""
    temps: list[str] = []
    try:
        for name, data in files.items():
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
            temps.append(tmp)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, _default_mode() if mode is None else mode)
        for name, tmp in zip(files, temps):
            os.replace(tmp, Path(directory) / name)
    except OSError as e:
        for tmp in temps:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        where = shown if shown is not None else directory
        raise OutputError(f"{flag} {where}: cannot write ({e.strerror or e}); nothing was written") from None
    return [Path(directory) / name for name in files]


def check_int(flag: str, value: int, lo: int, hi: int | None = None, why: str = "") -> None:
    """``lo <= value <= hi`` or a :class:`UsageError` naming ``flag`` (``why`` explains ``hi``)."""
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo:,}" if hi is None else f"between {lo:,} and {hi:,}"
        raise UsageError(f"{flag} must be {bound}{why}, got {value:,}")


def check_number(flag: str, value: float, *, lo: float = 0.0, lo_open: bool = True,
                 hi: float | None = None, why: str = "") -> None:
    """A finite ``value`` above ``lo`` (or at it, when ``lo_open`` is False) and at most ``hi``."""
    below = value <= lo if lo_open else value < lo
    if not math.isfinite(value) or below or (hi is not None and value > hi):
        bound = f"{'>' if lo_open else '>='} {lo:g}" + ("" if hi is None else f" and <= {_number(hi)}")
        raise UsageError(f"{flag} must be a finite number {bound}{why}, got {value:g}")


def _number(x: float) -> str:
    """``1048576.0`` -> ``1,048,576``; ``0.5`` -> ``0.5``."""
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:g}"


def check_out_dir(flag: str, path: Path) -> Path:
    """Create the output directory ``path`` now (before any work) and check it is writable."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot create the directory ({e.strerror or e})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: the directory is not writable")
    return path


def check_out_file(flag: str, path: Path) -> Path:
    """Check, before any work, that the file ``path`` can be written (its directory exists and
    is writable, and it is not itself a directory)."""
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory, not a file")
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")
    return path


def add_data_dir_argument(parser) -> None:
    """The ``--data-dir`` flag every trace-reading command takes (checked by :func:`check_data_dir`)."""
    parser.add_argument("--data-dir", type=Path, default=None, metavar="DIR",
                        help="a directory with your own copies of the public traces (default: the "
                             "ones shipped with pagedkv, or $PAGEDKV_DATA)")


def check_gpu_flags(args) -> None:
    """The memory and cost-model flags ``simulate`` and ``fleet`` share (``--gpu-mem-gib``,
    ``--util``, ``--kv-gib``, ``--bandwidth-tbs``, ``--tflops``, ``--overhead-ms``)."""
    from ..sim.sizing import MAX_MEMORY_GIB

    check_number("--gpu-mem-gib", args.gpu_mem_gib, hi=MAX_MEMORY_GIB, why=" (1 PiB)")
    check_number("--util", args.util, hi=1.0)
    if args.kv_gib is not None:
        check_number("--kv-gib", args.kv_gib, hi=MAX_MEMORY_GIB, why=" (1 PiB)")
    check_number("--bandwidth-tbs", args.bandwidth_tbs, hi=1e6)
    check_number("--tflops", args.tflops, hi=1e9)
    check_number("--overhead-ms", args.overhead_ms, lo_open=False, hi=1e6)


def check_data_dir(flag: str, path: Path | None) -> None:
    """``--data-dir`` (or ``$PAGEDKV_DATA`` when the flag is absent) must be a directory."""
    if path is not None:
        if not path.is_dir():
            raise UsageError(f"{flag} {path} is not a directory")
        return
    env = os.environ.get("PAGEDKV_DATA")
    if env is not None and not Path(env).expanduser().is_dir():
        raise UsageError(f"PAGEDKV_DATA={env} is not a directory (unset it to use the traces "
                         "shipped with pagedkv)")


def check_model(flag: str, name: str, *, grouped: bool = False):
    """The built-in model ``name`` (a ``ModelSpec``), or a :class:`UsageError` naming ``flag``.

    A hybrid model (sliding-window or chunked layers) is refused unless the command serves it
    grouped (``grouped=True``: ``simulate`` and ``fleet``, whose paged managers keep a table per
    attention group); a command that would size every layer for the whole context (``report``)
    would overstate its KV by half or more (``pagedkv size``)."""
    from ..sim.sizing import builtin_models, get_model

    try:
        spec = get_model(name)
    except ValueError:
        raise UsageError(f"{flag} {name!r} is not a built-in model; choose from "
                         f"{', '.join(builtin_models())} (pagedkv size --list)") from None
    if spec.is_hybrid and not grouped:
        raise UsageError(f"{flag} {spec.name} is a hybrid model (sliding-window or chunked layers), which this "
                         "command would size as if every layer kept the whole context; pagedkv simulate and "
                         f"pagedkv fleet serve it by attention group (--model {spec.name}), pagedkv size "
                         f"{spec.name} shows its grouped KV")
    return spec


def context_limit(args, spec, capacity: int | None, hi: int) -> tuple[int | None, str]:
    """``(context limit, where it came from in words)`` for a serving command: ``--max-len`` when
    given; else the model's own context (``max_position_embeddings``), at most ``hi`` and the
    ``capacity`` tokens one KV cache holds (None: no such cap; a command that reserves the limit
    for every request needs it, where vLLM would refuse to start). ``(None, "")`` when the
    model states no context: the caller takes its longest request. Example: gpt-oss-20b (131,072)
    on 502,432 KV slots -> ``(131072, "gpt-oss-20b's context")``; Llama-3.1-8B on ``--kv-gib 1``
    (8,192 slots) -> ``(8192, "what the KV cache holds (Llama-3.1-8B's context is 131,072)")``."""
    if args.max_len is not None:
        return args.max_len, "--max-len"
    if spec.max_context is None:
        return None, ""
    limit = min(spec.max_context, hi if capacity is None else capacity, hi)
    if limit == spec.max_context:
        return limit, f"{spec.name}'s context"
    held = "what the KV cache holds" if limit == capacity else "the simulator's limit"
    return limit, f"{held} ({spec.name}'s context is {spec.max_context:,})"


def check_requests_fit(requests, allocator, limit: int, origin: str, where: str = "the KV cache") -> None:
    """A :class:`UsageError` in the command's words when the longest of ``requests`` (already
    cut to the context ``limit``, which came from ``origin``) cannot fit ``allocator``'s whole
    cache even alone: it could never run. Says the flags that fix it. Example: a 1,891-token
    request on 5 blocks of 16 needs 119 blocks; a limit of 80 tokens would fit."""
    from ..sim.scheduler import check_fits

    try:
        check_fits(requests, allocator, limit)
    except ValueError:
        longest = max(requests, key=lambda r: r.total_len)
        bs, groups = allocator.block_size, getattr(allocator, "num_groups", 1)
        need, blocks = allocator.prompt_blocks(longest.total_len), allocator.capacity // bs
        per_group = f" ({groups} attention groups)" if groups > 1 else ""
        now = f"now {limit:,}" + ("" if origin == "--max-len" else f": {origin}")
        raise UsageError(f"request {longest.req_id} needs {longest.total_len:,} tokens, {need:,} blocks of {bs}"
                         f"{per_group}, but {where} holds {blocks:,} blocks: it could never run; give more KV "
                         f"memory (--kv-gib, --gpu-mem-gib) or --max-len {blocks // groups * bs:,} or less "
                         f"({now})") from None


def progress_bar(args, total: int, label: str):
    """The progress bar a long command draws on stderr (a :class:`~pagedkv.sim.progress.Progress`
    over ``total`` steps), or None: drawn from the start when ``--progress`` asks for it; drawn
    unasked when stderr is a terminal, once the run has taken :data:`AUTO_PROGRESS_DELAY_S`; never
    on a redirected stderr unless asked (a log file gets no bar)."""
    from ..sim.progress import Progress

    asked = bool(getattr(args, "progress", False))
    if not asked:
        try:
            if not sys.stderr.isatty():
                return None
        except (AttributeError, ValueError):  # no stderr, or a closed one
            return None
    return Progress(total, label, delay=0.0 if asked else AUTO_PROGRESS_DELAY_S)


def attention_name(a) -> str:
    """An attention spec in plain words: ``SlidingWindow(128)`` -> "sliding window 128",
    ``ChunkedLocalAttention(8192)`` -> "chunked local 8,192", ``FullAttention()`` -> "full"."""
    if a.kind == "sliding_window":
        return f"sliding window {a.window:,}"
    if a.kind == "chunked_local_attention":
        return f"chunked local {a.chunk:,}"
    return "full"


def _weights(args, spec) -> int:
    """The weight bytes of one GPU: ``--weights-gib`` where the command has it and it is given,
    else sizing's estimate; a :class:`UsageError` when neither exists (mixture-of-experts, MLA)."""
    from ..sim import sizing

    given = getattr(args, "weights_gib", None)
    if given is not None:
        return int(given * sizing.GIB)
    weights = sizing.estimate_weight_bytes(spec)
    if weights is None:
        hint = "; give --weights-gib" if hasattr(args, "weights_gib") else "; choose a dense model"
        raise UsageError(f"--model {spec.name}: cannot estimate the weights of a mixture-of-experts "
                         f"or MLA model{hint}")
    return weights


def _kv_budget(args, spec, weights: int, size) -> tuple[int, str]:
    """(KV budget in bytes, the flag that set it): ``--kv-gib``, or what the weights leave of
    ``--gpu-mem-gib x --util``."""
    from ..sim import sizing

    if args.kv_gib is not None:
        return int(args.kv_gib * sizing.GIB), f"--kv-gib {args.kv_gib:g}"
    if args.gpu_mem_gib * args.util - weights / sizing.GIB <= 0:
        raise UsageError(f"--gpu-mem-gib {args.gpu_mem_gib:g} x --util {args.util:g} leaves nothing "
                         f"for KV after {spec.name}'s {weights / sizing.GIB:.2f} GiB of weights")
    return (sizing.fit_blocks(size, gpu_mem_gib=args.gpu_mem_gib, util=args.util,
                              weights_gib=weights / sizing.GIB).kv_budget_bytes,
            f"--gpu-mem-gib {args.gpu_mem_gib:g}")


def _check_blocks(flag: str, num_blocks: int, block_bytes: int, model: str, block_size: int, per: str) -> None:
    if num_blocks < 1:
        raise UsageError(f"{flag} leaves no room for one block ({block_bytes / 2**20:g} MiB of "
                         f"{model} KV at block size {block_size})")
    limit = min(MAX_BLOCKS, MAX_SLOTS // block_size)
    if num_blocks > limit:
        gib = limit * block_bytes / 2**30
        raise UsageError(f"{flag} makes {num_blocks:,} blocks{per}; the simulator holds at most {limit:,} "
                         f"({gib:,.0f} GiB of {model} KV at block size {block_size}): "
                         "give a smaller size")


def kv_memory(args, per: str = "", *, grouped: bool = False):
    """``(num_blocks, cost model)`` of one replica for the ``--model``, the GPU flags and
    ``--block-size`` that ``simulate`` and ``fleet`` share: the KV memory is ``--kv-gib``, or what
    the weights leave of ``--gpu-mem-gib x --util``; the cost model prices steps on that GPU.
    ``num_blocks`` are uniform blocks (every layer's K/V); with ``grouped=True`` a hybrid model
    is accepted (:func:`grouped_kv_memory` gives its grouped blocks).

    Refused with a :class:`UsageError` naming the flag: a model whose weights cannot be estimated
    (mixture-of-experts, MLA) unless ``--weights-gib`` gives them, weights that leave nothing
    for KV, a memory without room for one block, or more blocks than one simulated replica holds
    (:data:`MAX_BLOCKS`, and slot ids must fit int32). ``per`` qualifies the block count in the
    message (``" per replica"``). Worked example: Llama-3.1-8B (14.96 GiB of weights) on 80 GiB
    at 0.9 leaves 72 - 14.96 = 57.04 GiB of KV: 29,206 blocks of 16 tokens at 2 MiB each.
    """
    from ..sim import sizing
    from ..sim.costmodel import CostModel

    spec = check_model("--model", args.model, grouped=grouped)
    weights = _weights(args, spec)
    size = sizing.kv_size(spec, block_size=args.block_size)
    budget, flag = _kv_budget(args, spec, weights, size)
    num_blocks = budget // size.bytes_per_block
    _check_blocks(flag, num_blocks, size.bytes_per_block, size.model, args.block_size, per)
    cost = CostModel(kv_bytes_per_token=size.bytes_per_token, weight_bytes=weights,
                     bandwidth=args.bandwidth_tbs * 1e12, peak_flops=args.tflops * 1e12,
                     overhead_s=args.overhead_ms / 1e3, model=spec.name)
    return num_blocks, cost


def grouped_kv_memory(args, per: str = ""):
    """The ``--model``'s KV budget (as :func:`kv_memory` computes it) held by attention group: a
    :class:`~pagedkv.sim.hybrid_serving.HybridMemory` whose grouped blocks are checked against
    the simulator's limit as the uniform ones are. gpt-oss-20b, ``--kv-gib 1``: 1,365 uniform
    blocks of 16 tokens, 2,730 grouped."""
    from ..sim import sizing
    from ..sim.hybrid_serving import hybrid_memory

    spec = check_model("--model", args.model, grouped=True)
    weights = _weights(args, spec)
    size = sizing.kv_size(spec, block_size=args.block_size)
    budget, flag = _kv_budget(args, spec, weights, size)
    memory = hybrid_memory(spec, budget, block_size=args.block_size)
    _check_blocks(flag, memory.grouped_blocks, memory.grouped_block_bytes, spec.name, args.block_size, per)
    return memory
