"""Shared fixtures and helpers for the tests, and the suite-wide hooks.

CI (``CI`` set to anything but ``""``, ``0``, ``false`` or ``no``; ``.ci/run`` sets ``CI=true``)
installs every extra, so there nothing may skip: the optional packages are imported up front
(a missing one stops the run with a message saying which), the xxh3 parameter has no skip mark,
and any test that still skips turns the run's exit status into a failure. A selection that runs
no test is pytest's exit status 5, a failure as well: CI cannot pass on nothing.

Hypothesis profiles: ``ci`` (default; bounded so that the whole core suite stays well under three
minutes on two cores: about a minute), ``dev`` (more examples) and ``thorough`` (a long local
soak, tens of minutes). Pick one with ``HYPOTHESIS_PROFILE=thorough pytest ...``. The sha256
state machine in test_stateful.py (the backbone) runs ``STATEFUL_FACTOR`` times the profile's
``max_examples``; the builtin and xxh3 variants run the profile's own number.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

pytest_plugins = ["pytester"]  # tests/test_ci.py runs pytest on small suites to test these hooks

settings.register_profile(
    "ci",
    max_examples=100,  # hypothesis' default: other modules' @given tests keep their cost
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile(
    "dev", max_examples=200, stateful_step_count=60, deadline=None, print_blob=True
)
settings.register_profile(
    "thorough",
    max_examples=1000,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
CI_PACKAGES = ("torch", "transformers", "xxhash", "matplotlib")
_skipped: list[str] = []


def pytest_configure(config):
    """Under CI every optional package must import: CI installs the ``test`` extra, so a missing
    one is a broken install, reported as one before any test runs."""
    if CI:
        missing = [name for name in CI_PACKAGES if importlib.util.find_spec(name) is None]
        if missing:
            pytest.exit(f"CI is set but {', '.join(missing)} cannot be imported: install the test "
                        "extra (pip install -e '.[test]')", returncode=pytest.ExitCode.USAGE_ERROR)


def _note_skip(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append(report.nodeid or "<collection>")


def pytest_runtest_logreport(report):
    _note_skip(report)


def pytest_collectreport(report):
    _note_skip(report)


def pytest_sessionfinish(session, exitstatus):
    """Under CI a run with any skipped test fails (exit status 1), however green the rest."""
    if CI and _skipped and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if CI and _skipped:
        terminalreporter.write_line(
            f"CI is set and {len(_skipped)} test(s) skipped, which fails the run (CI installs every "
            f"extra, so nothing may skip): {', '.join(_skipped[:10])}", red=True, bold=True)


@pytest.fixture(scope="module")
def one_torch_thread():
    """The test models are tiny: a second intra-op thread only adds spin-waits (transformers'
    generate ran 10x slower with the two cores shared). Restored afterwards."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf():
    """The tiny Llama in transformers (tests/llama_setup.py), built once per module (the oracle
    suites; a numpy suite never asks for it)."""
    from llama_setup import tiny_llama

    return tiny_llama()


@pytest.fixture(scope="module", params=["torch", "numpy"])
def model(hf, request):
    """The same transformers weights on either backend of PagedLlama (a numpy suite defines its
    own ``model``, with seeded numpy weights)."""
    from pagedkv.model import PagedLlama

    return PagedLlama.from_transformers(hf, backend=request.param)


STATEFUL_FACTOR = 4

HAVE_XXHASH = importlib.util.find_spec("xxhash") is not None
ALGOS = [
    "sha256",
    "builtin",
    # Outside CI a missing xxhash skips xxh3; under CI the test runs, and fails without it.
    pytest.param("xxh3", marks=pytest.mark.skipif(not HAVE_XXHASH and not CI, reason="needs xxhash")),
]


@pytest.fixture(params=ALGOS)
def algo(request) -> str:
    """Every hash algorithm the manager supports."""
    return request.param


@pytest.fixture
def make(algo):
    """Factory for a manager with the parametrised hash algorithm (caching on by default)."""
    from pagedkv import KVCacheManager

    def _make(num_blocks: int = 16, block_size: int = 4, **kw):
        kw.setdefault("hash_algo", algo)
        return KVCacheManager(num_blocks=num_blocks, block_size=block_size, **kw)

    return _make


class SlotStore:
    """A simulated KV store: one token id per physical slot (-1 = never written).

    It behaves like an engine's KV tensors: ``copy`` executes a CopyOp (all ``block_size`` slots of
    ``src`` into ``dst``), ``write`` puts token states at slots, and ``read`` gathers a sequence's
    tokens back through its block table.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.data = np.full(num_blocks * block_size, -1, dtype=np.int64)

    def copy(self, ops) -> None:
        bs = self.bs
        for op in ops:
            self.data[op.dst * bs : (op.dst + 1) * bs] = self.data[op.src * bs : (op.src + 1) * bs]

    def write(self, slots, tokens) -> None:
        self.data[np.asarray(slots, dtype=np.int64)] = np.asarray(tokens, dtype=np.int64)

    def slots_of(self, table, start: int, stop: int) -> np.ndarray:
        pos = np.arange(start, stop, dtype=np.int64)
        tab = np.asarray(table, dtype=np.int64)
        return tab[pos // self.bs] * self.bs + pos % self.bs

    def write_prompt(self, table, prompt, hit: int) -> None:
        """What an engine does after add_sequence: compute and write positions >= hit."""
        self.write(self.slots_of(table, hit, len(prompt)), list(prompt)[hit:])

    def read(self, table, n: int) -> list[int]:
        return self.data[self.slots_of(table, 0, n)].tolist()


def stored_blocks(events):
    """Flatten BlockStored events to one (hash, parent_hash, block_tokens) per published block.

    A router may receive one event per block or one per run of blocks; either way each block's
    parent is the previous block's hash within an event, and ``token_ids`` holds every block's
    tokens concatenated.
    """
    from pagedkv import BlockStored

    out = []
    for ev in events:
        if not isinstance(ev, BlockStored):
            continue
        bs = ev.block_size
        assert len(ev.token_ids) == bs * len(ev.block_hashes), ev
        parent = ev.parent_block_hash
        for i, h in enumerate(ev.block_hashes):
            out.append((h, parent, tuple(ev.token_ids[i * bs : (i + 1) * bs])))
            parent = h
    return out


def stored_keys(events):
    """One ``(hash, lora_name, extra keys entry)`` per block the BlockStored events publish, in
    the order of :func:`stored_blocks` (the entry None when the event has no ``extra_keys``)."""
    from pagedkv import BlockStored

    out = []
    for ev in events:
        if isinstance(ev, BlockStored):
            assert ev.extra_keys is None or len(ev.extra_keys) == len(ev.block_hashes), ev
            for i, h in enumerate(ev.block_hashes):
                out.append((h, ev.lora_name, ev.extra_keys[i] if ev.extra_keys is not None else None))
    return out


def removed_hashes(events) -> list:
    from pagedkv import BlockRemoved

    return [h for ev in events if isinstance(ev, BlockRemoved) for h in ev.block_hashes]


def snapshot(m, seq_ids=None) -> dict:
    """Everything an atomic failure must leave unchanged (excluding drained queues)."""
    if seq_ids is None:
        seq_ids = []
    return {
        "tables": {s: list(m.block_table(s)) for s in seq_ids},
        "num_tokens": {s: m.num_tokens(s) for s in seq_ids},
        "tokens": {s: list(m.tokens(s)) for s in seq_ids},
        "refcounts": [m.refcount(b) for b in range(m.num_blocks)],
        "num_free": m.num_free_blocks,
        "num_sequences": m.num_sequences,
        "usage": m.usage(),
    }


def toks(start: int, n: int) -> list[int]:
    """``n`` distinct token ids starting at ``start`` (distinct prompts never share a block)."""
    return list(range(start, start + n))


def snapshot_v2(m, seq_ids=None) -> dict:
    """``snapshot`` plus each sequence's ``num_computed`` (contract v2): what a failing v2 call
    must leave unchanged."""
    out = snapshot(m, seq_ids)
    out["num_computed"] = {s: m.num_computed(s) for s in (seq_ids or [])}
    return out
