"""nano-vllm's own scheduler, sequence and block manager, found and loaded as files, torch-free.

nano-vllm (github.com/GeeeekExplorer/nano-vllm) is not on PyPI under its own name, and the
copies there (forks) change the engine and declare torch as a dependency; its package's
``__init__`` imports the whole engine (torch, transformers, flash-attn). Its
``nanovllm/engine/scheduler.py``, ``sequence.py`` and ``block_manager.py`` need only the standard
library, numpy and xxhash, plus two names of their own package: ``nanovllm.config.Config`` (a
type annotation; the real one loads a Hugging Face model config) and
``nanovllm.sampling_params.SamplingParams`` (a default argument of ``Sequence``). Those are
stubbed while the three files load, and every ``nanovllm`` name the loading put in
``sys.modules`` is taken out again after, so nothing of nano-vllm stays importable.

Where the files come from (:func:`find_engine`): a path given (``pagedkv report --nanovllm``),
else ``$PAGEDKV_NANOVLLM``, else an installed ``nanovllm`` package (found without importing it),
else none, and the caller runs :mod:`pagedkv.sim.nanovllm_rules` instead. A path given that holds
no such engine is a ValueError; an installed package of another shape (a fork) is passed over,
with the reason kept for the report. What this module may import: the standard library and the
engine written here; it must never import nano-vllm's package itself.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Engine", "ENV", "FILES", "load_engine", "find_engine", "rules_engine"]

ENV = "PAGEDKV_NANOVLLM"  # a nano-vllm checkout, when --nanovllm is not given
FILES = ("sequence.py", "block_manager.py", "scheduler.py")  # in load order: each imports the ones before
_STUBS = ("nanovllm", "nanovllm.engine", "nanovllm.config", "nanovllm.sampling_params")


@dataclass(frozen=True)
class Engine:
    """The three classes a replay needs, and where they come from, in words for the report."""

    Scheduler: type
    Sequence: type
    BlockManager: type
    source: str
    own: bool  # nano-vllm's own files (True) or the engine written here (False)


class _SamplingParams:
    """What nano-vllm's ``Sequence`` reads of its sampling parameters (its default argument)."""

    def __init__(self, temperature: float = 1.0, max_tokens: int = 64, ignore_eos: bool = False):
        self.temperature, self.max_tokens, self.ignore_eos = temperature, max_tokens, ignore_eos


def _package_dir(path, name: str) -> Path:
    """The ``nanovllm`` package directory of a checkout (or the package directory itself)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{name} must be a path to a nano-vllm checkout, got {type(path).__name__}")
    root = Path(path).expanduser()
    for pkg in (root / "nanovllm", root):
        if all((pkg / "engine" / file).is_file() for file in FILES):
            return pkg
    raise ValueError(f"{name} {str(path)!r}: no nano-vllm engine there (expected nanovllm/engine/"
                     f"{{{','.join(FILES)}}} in a checkout of github.com/GeeeekExplorer/nano-vllm)")


def _exec_files(engine_dir: Path, name: str) -> dict[str, types.ModuleType]:
    """Run the three files under their own module names, with the stubs, then unregister all."""
    names = [f"nanovllm.engine.{f[:-3]}" for f in FILES]
    saved = {m: sys.modules.get(m) for m in (*_STUBS, *names)}
    stubs = {m: types.ModuleType(m) for m in _STUBS}
    stubs["nanovllm"].__path__ = stubs["nanovllm.engine"].__path__ = []  # packages, no files
    stubs["nanovllm.config"].Config = object
    stubs["nanovllm.sampling_params"].SamplingParams = _SamplingParams
    sys.modules.update(stubs)
    loaded = {}
    try:
        for module_name, file in zip(names, FILES):
            spec = importlib.util.spec_from_file_location(module_name, engine_dir / file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as e:  # foreign code: any failure is "not a usable engine"
                raise ValueError(f"{name} {str(engine_dir.parent)!r}: cannot load "
                                 f"engine/{file} ({type(e).__name__}: {e})") from None
            loaded[file] = module
    finally:
        for module_name, old in saved.items():
            if old is None:
                sys.modules.pop(module_name, None)
            else:
                sys.modules[module_name] = old
    return loaded


def _shape_problem(modules: dict[str, types.ModuleType]) -> str | None:
    """Why these files are not the engine the replay drives (None when they are): the scheduler
    with chunked prefill, whose ``allocate`` takes the cached block count ``can_allocate`` found."""
    sched = getattr(modules["scheduler.py"], "Scheduler", None)
    bm = getattr(modules["block_manager.py"], "BlockManager", None)
    seq = getattr(modules["sequence.py"], "Sequence", None)
    if not (isinstance(sched, type) and isinstance(bm, type) and isinstance(seq, type)):
        return "Scheduler, BlockManager or Sequence is missing"
    methods = ("can_allocate", "allocate", "deallocate", "can_append", "may_append", "hash_blocks")
    missing = [m for m in methods if not callable(getattr(bm, m, None))]
    if missing:
        return f"its BlockManager has no {', '.join(missing)}"
    if len(inspect.signature(bm.allocate).parameters) != 3:
        return "its BlockManager.allocate does not take num_cached_blocks (an engine before chunked prefill)"
    post = getattr(sched, "postprocess", None)
    if not callable(post) or len(inspect.signature(post).parameters) != 4:
        return "its Scheduler.postprocess does not take (seqs, token_ids, is_prefill)"
    try:
        probe = seq([1, 2, 3], _SamplingParams())
    except Exception as e:  # foreign code
        return f"its Sequence(token_ids, sampling_params) fails ({type(e).__name__}: {e})"
    if not hasattr(probe, "num_scheduled_tokens"):
        return "its Sequence has no num_scheduled_tokens"
    return None


def load_engine(path, name: str = "nanovllm") -> Engine:
    """nano-vllm's own engine from the checkout at ``path``; a ValueError naming ``name`` (the
    argument or variable ``path`` came from) when it holds none.

    Example: ``load_engine("/tmp/nano-vllm").source`` is ``"nano-vllm's own sequence.py,
    block_manager.py, scheduler.py from /tmp/nano-vllm/nanovllm/engine"``.
    """
    pkg = _package_dir(path, name)
    modules = _exec_files(pkg / "engine", name)
    problem = _shape_problem(modules)
    if problem is not None:
        raise ValueError(f"{name} {str(path)!r}: not the nano-vllm engine this replay drives: {problem}")
    source = f"nano-vllm's own {', '.join(FILES)} from {pkg / 'engine'}"
    return Engine(modules["scheduler.py"].Scheduler, modules["sequence.py"].Sequence,
                  modules["block_manager.py"].BlockManager, source, True)


def rules_engine(reason: str) -> Engine:
    """The engine written here with nano-vllm's rules; ``reason`` says why it runs."""
    from . import nanovllm_rules as rules

    return Engine(rules.Scheduler, rules.Sequence, rules.BlockManager, f"{rules.SOURCE} ({reason})", False)


def find_engine(path=None) -> Engine:
    """nano-vllm's own engine wherever it is available, else the one written here.

    Order: ``path``; ``$PAGEDKV_NANOVLLM``; an installed ``nanovllm`` package. The first two must
    hold the engine (ValueError otherwise); an installed package of another shape is passed over.
    """
    if path is not None:
        return load_engine(path)
    env = os.environ.get(ENV)
    if env:
        return load_engine(env, f"${ENV}")
    try:
        spec = importlib.util.find_spec("nanovllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return rules_engine(f"no nano-vllm found: give --nanovllm PATH or ${ENV} to run its own files")
    installed = Path(next(iter(spec.submodule_search_locations)))
    try:
        return load_engine(installed, "the installed nanovllm")
    except ValueError as e:
        return rules_engine(f"passed over: {e}")
