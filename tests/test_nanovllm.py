"""pagedkv.integrations.nanovllm.BlockManager under a scheduler loop of nano-vllm's shape.

The loop here is written for these tests (nano-vllm's code is not in this repository): a
``Seq`` with the attributes nano-vllm's ``Sequence`` has, a scheduler with nano-vllm's prefill
then decode phases (chunked prefill for the first waiting sequence only, preemption from the tail
of the running queue), its ``postprocess`` (``hash_blocks`` before the scheduled tokens count),
and a model runner that computes slots from ``seq.block_table`` exactly as nano-vllm's does. A
slot store stands for the KV cache: every step writes its positions' tokens at their slots, and
attention reads every position of the sequence back through the block table, so a hit on a block
that was never written, or was overwritten, fails the step.
"""
from __future__ import annotations

from collections import deque
from itertools import count

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import OutOfBlocks
from pagedkv.integrations.nanovllm import BlockManager
from conftest import SlotStore, toks

VOCAB = 50_000


class Seq:
    """The attributes of nano-vllm's Sequence that its scheduler, block manager and runner use."""

    ids = count()

    def __init__(self, token_ids, max_tokens: int, block_size: int):
        self.seq_id = next(Seq.ids)
        self.token_ids = list(token_ids)
        self.last_token = self.token_ids[-1]
        self.num_tokens = self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.block_table: list[int] = []
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.finished = False

    def __len__(self):
        return self.num_tokens

    @property
    def num_blocks(self):
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self):
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def append_token(self, token_id: int):
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1


def next_token(seq: Seq) -> int:
    """A deterministic 'model': the next token is a function of the sequence's content."""
    return (seq.token_ids[-1] * 7919 + seq.num_tokens * 31) % VOCAB


class Engine:
    """nano-vllm's scheduler, postprocess and model runner, over ``bm`` and a slot store."""

    def __init__(self, bm: BlockManager, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm, self.bs = bm, bm.block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Seq] = deque()
        self.running: deque[Seq] = deque()
        self.store = SlotStore(num_blocks, self.bs)
        self.preemptions = 0
        self.hit_tokens = 0
        self.steps = 0
        self.stored = 0  # blocks published, all by postprocess (hash_blocks)

    def add(self, seq: Seq):
        self.waiting.append(seq)

    def schedule(self):
        bm, scheduled, batched = self.bm, [], 0
        while self.waiting and len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            remaining = self.max_num_batched_tokens - batched
            if remaining == 0:
                break
            if not seq.block_table:
                cached = bm.can_allocate(seq)
                # the probing answer is the whole prompt's: hits, and whether it fits
                hit = bm.manager.lookup(seq.token_ids)
                need = seq.num_blocks - hit.device // self.bs + hit.revived
                assert cached == (hit // self.bs if need <= bm.manager.num_free_blocks else -1)
                if cached == -1:
                    break
                num_tokens = seq.num_tokens - cached * self.bs
            else:
                num_tokens = seq.num_tokens - seq.num_cached_tokens
            if remaining < num_tokens and scheduled:
                break
            if not seq.block_table:
                bm.allocate(seq, cached)
                self.hit_tokens += seq.num_cached_tokens
                # a hit reads K/V that a computed position wrote
                assert self.store.read(seq.block_table, seq.num_cached_tokens) == seq.token_ids[: seq.num_cached_tokens]
            seq.num_scheduled_tokens = min(num_tokens, remaining)
            batched += seq.num_scheduled_tokens
            if seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens:
                self.waiting.popleft()
                self.running.append(seq)
            scheduled.append(seq)
        if scheduled:
            return scheduled, True
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not bm.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                seq.num_scheduled_tokens = 1
                bm.may_append(seq)
                scheduled.append(seq)
        assert scheduled
        self.running.extendleft(reversed(scheduled))
        return scheduled, False

    def preempt(self, seq: Seq):
        self.preemptions += 1
        self.bm.deallocate(seq)
        self.waiting.appendleft(seq)

    def run(self, seqs, is_prefill: bool) -> list[int]:
        """nano-vllm's prepare_prefill / prepare_decode slot mapping, then 'attention'."""
        bs, store = self.bs, self.store
        for seq in seqs:
            if is_prefill:
                start, end = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens
                slots = [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]
                store.write(slots, seq.token_ids[start:end])
            else:
                assert len(seq.block_table) == seq.num_blocks
                store.write([seq.block_table[-1] * bs + seq.last_block_num_tokens - 1], [seq.last_token])
                end = seq.num_tokens
            assert store.read(seq.block_table, end) == seq.token_ids[:end], "attention read a wrong slot"
        return [next_token(seq) for seq in seqs]

    def postprocess(self, seqs, token_ids, is_prefill: bool):
        for seq, token_id in zip(seqs, token_ids):
            self.bm.hash_blocks(seq)
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if is_prefill and seq.num_cached_tokens < seq.num_tokens:
                continue
            seq.append_token(token_id)
            if seq.num_tokens - seq.num_prompt_tokens == seq.max_tokens:
                seq.finished = True
                self.bm.deallocate(seq)
                self.running.remove(seq)

    def step(self):
        seqs, is_prefill = self.schedule()
        self.check_scheduled(seqs, is_prefill)
        token_ids = self.run(seqs, is_prefill)
        self.postprocess(seqs, token_ids, is_prefill)
        self.check()
        self.steps += 1

    def check_scheduled(self, seqs, is_prefill: bool):
        """Before the forward pass nothing the step computes is findable: the manager has
        scheduled exactly the computed positions, and the step published no block."""
        m = self.bm.manager
        for seq in seqs:
            if is_prefill:
                assert m.num_computed(seq.seq_id) == seq.num_cached_tokens
            else:  # the decode token is in the manager only when it opened a block
                assert m.num_computed(seq.seq_id) in (seq.num_tokens - 1, seq.num_tokens)
        events = m.take_events()
        assert not any(type(e).__name__ == "BlockStored" for e in events), "schedule() published a block"

    def check(self):
        m = self.bm.manager
        m.check_invariants()
        self.stored += sum(len(e.block_hashes) for e in m.take_events() if type(e).__name__ == "BlockStored")
        bs = self.bs
        for seq in self.running:  # the newest token gets its block, if it opens one, in may_append
            assert seq.block_table == m.reserved_table(seq.seq_id)
            assert len(seq.block_table) == -(-seq.num_cached_tokens // bs)
            assert seq.num_cached_tokens == seq.num_tokens - 1 == m.num_tokens(seq.seq_id)
        for seq in self.waiting:
            if seq.block_table:  # mid-prefill: every prompt position holds a block
                assert seq.block_table == m.reserved_table(seq.seq_id)
                assert len(seq.block_table) == seq.num_blocks
                assert m.num_computed(seq.seq_id) == seq.num_cached_tokens
        live = sum(1 for s in list(self.running) + list(self.waiting) if s.block_table)
        assert m.num_sequences == live

    def drain(self, max_steps: int = 100_000):
        while self.waiting or self.running:
            self.step()
            assert self.steps < max_steps, "the loop does not finish"


def make_engine(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, **kw):
    bm = BlockManager(num_blocks, block_size, enable_events=True, **kw)
    return Engine(bm, num_blocks, max_num_seqs, max_num_batched_tokens)


# ---------------------------------------------------------------- exact cases


def test_methods_on_one_sequence():
    """Block size 4, a 10-token prompt: 3 blocks at once, nothing findable until computed."""
    bm = BlockManager(16, 4)
    seq = Seq(toks(100, 10), max_tokens=4, block_size=4)
    assert bm.can_allocate(seq) == 0
    bm.allocate(seq, 0)
    assert (seq.block_table, seq.num_cached_tokens) == ([0, 1, 2], 0)
    assert bm.manager.lookup(seq.token_ids) == 0
    seq.num_scheduled_tokens = 6  # a first chunk of 6
    bm.hash_blocks(seq)
    seq.num_cached_tokens, seq.num_scheduled_tokens = 6, 4
    assert bm.manager.lookup(seq.token_ids) == 4
    bm.hash_blocks(seq)
    seq.num_cached_tokens, seq.num_scheduled_tokens = 10, 0
    assert bm.manager.lookup(seq.token_ids) == 8
    assert bm.manager.num_free_blocks == 13  # the chunks took nothing
    seq.append_token(5)  # 11 tokens: no new block
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert seq.block_table == [0, 1, 2]
    bm.hash_blocks(seq)  # the decode step computed position 10
    seq.append_token(6)
    bm.may_append(seq)
    bm.hash_blocks(seq)  # position 11 fills block 2: published now
    assert bm.manager.lookup(seq.token_ids + [1]) == 12
    seq.append_token(7)  # 13 tokens: len % 4 == 1 takes a block
    bm.may_append(seq)
    assert seq.block_table == [0, 1, 2, 3]
    bm.hash_blocks(seq)
    bm.manager.check_invariants()
    bm.deallocate(seq)
    assert (seq.block_table, seq.num_cached_tokens) == ([], 0)
    assert bm.manager.num_free_blocks == 16
    again = Seq(seq.token_ids, max_tokens=1, block_size=4)  # a preempted sequence comes back
    assert bm.can_allocate(again) == 3


def test_can_allocate_counts_a_cached_free_hit_as_a_free_block():
    """4 blocks; a 9-token prompt computed and freed leaves 2 cached blocks. The same prompt
    extended to 12 tokens needs 3 blocks: 2 revived (each takes a free block) and 1 new."""
    bm = BlockManager(4, 4)
    a = Seq(toks(0, 9), max_tokens=1, block_size=4)
    bm.allocate(a, bm.can_allocate(a))
    a.num_scheduled_tokens = 9
    bm.hash_blocks(a)
    bm.deallocate(a)
    b = Seq(toks(0, 12), max_tokens=1, block_size=4)
    assert bm.can_allocate(b) == 2
    hold = Seq(toks(500, 4), max_tokens=1, block_size=4)  # one clean block taken: 3 free left
    bm.allocate(hold, bm.can_allocate(hold))
    assert bm.manager.num_free_blocks == 3
    assert bm.can_allocate(b) == 2  # 2 revived + 1 new = 3 <= 3
    hold2 = Seq(toks(900, 4), max_tokens=1, block_size=4)
    bm.allocate(hold2, bm.can_allocate(hold2))  # takes the last clean block: 2 free, both cached
    assert bm.can_allocate(b) == -1


def test_allocate_with_a_stale_count_is_refused_and_changes_nothing():
    bm = BlockManager(16, 4)
    a = Seq(toks(0, 9), max_tokens=1, block_size=4)
    bm.allocate(a, bm.can_allocate(a))
    a.num_scheduled_tokens = 9
    bm.hash_blocks(a)
    b = Seq(toks(0, 9), max_tokens=1, block_size=4)
    free = bm.manager.num_free_blocks
    with pytest.raises(ValueError, match="serves 2 blocks now"):
        bm.allocate(b, 0)
    assert (b.block_table, bm.manager.num_free_blocks, bm.manager.num_sequences) == ([], free, 1)
    bm.allocate(b, 2)  # without a can_allocate first, a right count is accepted
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate(b, 2)
    bm.manager.check_invariants()


def test_deallocate_of_an_unallocated_sequence_is_a_no_op():
    bm = BlockManager(8, 4)
    seq = Seq(toks(0, 5), max_tokens=1, block_size=4)
    bm.deallocate(seq)
    assert (seq.block_table, seq.num_cached_tokens, bm.manager.num_free_blocks) == ([], 0, 8)


def test_allocate_out_of_blocks_changes_nothing():
    bm = BlockManager(2, 4)
    seq = Seq(toks(0, 9), max_tokens=1, block_size=4)
    assert bm.can_allocate(seq) == -1
    with pytest.raises(OutOfBlocks):
        bm.allocate(seq, 0)
    assert (seq.block_table, bm.manager.num_free_blocks, bm.manager.num_sequences) == ([], 2, 0)


@pytest.mark.parametrize("bs", [1, 0, -4, 2.0])
def test_bad_block_sizes(bs):
    with pytest.raises(ValueError):
        BlockManager(8, bs)


def test_mid_prefill_deallocate_keeps_computed_blocks_and_returns_reserved_ones_clean():
    bm = BlockManager(16, 4)
    seq = Seq(toks(0, 14), max_tokens=1, block_size=4)
    bm.allocate(seq, bm.can_allocate(seq))
    seq.num_scheduled_tokens = 9
    bm.hash_blocks(seq)
    seq.num_cached_tokens = 9
    bm.deallocate(seq)
    u = bm.manager.usage()
    assert (u.used_blocks, u.cached_blocks) == (0, 2)
    assert bm.can_allocate(Seq(toks(0, 14), max_tokens=1, block_size=4)) == 2


# ---------------------------------------------------------------- the loop


def test_loop_with_shared_prefixes_preemption_and_chunks():
    """Twenty requests over four shared stems, a pool that forces preemption, chunks of at most
    32 tokens: every step reads its own tokens back; hits happen; preemptions happen."""
    eng = make_engine(num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=32)
    stems = [toks(1000 * i, 20) for i in range(4)]
    for i in range(20):
        eng.add(Seq(stems[i % 4] + toks(100_000 + 100 * i, 1 + i % 7), max_tokens=3 + i % 11, block_size=4))
    eng.drain()
    assert eng.preemptions > 0
    assert eng.hit_tokens > 0
    assert eng.stored > 0
    assert eng.bm.manager.num_sequences == 0
    assert eng.bm.manager.usage().used_blocks == 0


@settings(max_examples=60)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 20)), min_size=1, max_size=16),
    st.sampled_from([2, 4, 16]),
    st.integers(0, 12),
    st.integers(4, 64),
    st.integers(1, 8),
)
def test_loop_random(reqs, bs, spare, budget, max_seqs):
    """Random prompts (shared stems or not), block sizes, pools from barely enough to roomy,
    token budgets and batch widths: the loop finishes, every step reads back its own tokens, and
    the adapter's tables, counts and the manager's invariants agree after every step."""
    longest = max(((20 if kind < 3 else 0) + length + out + bs - 1) // bs for kind, length, out in reqs)
    num_blocks = longest + spare
    eng = make_engine(num_blocks=num_blocks, block_size=bs, max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    stems = [toks(1000 * i, 20) for i in range(3)]
    for i, (kind, length, out) in enumerate(reqs):
        prompt = (stems[kind] if kind < 3 else []) + toks(100_000 + 1000 * i, length)
        eng.add(Seq(prompt, max_tokens=out, block_size=bs))
    eng.drain()
    assert eng.bm.manager.usage().used_blocks == 0


def test_benchmark_script_runs_on_a_stand_in_checkout(tmp_path, capsys):
    """benchmarks/nanovllm_ab.py loads block_manager.py alone from a checkout, with
    ``nanovllm.engine.sequence`` stubbed while it loads and removed after. A stand-in checkout
    (its manager is pagedkv's adapter) stands for nano-vllm, which is not a dependency."""
    import importlib.util
    import sys
    from pathlib import Path

    engine = tmp_path / "nanovllm" / "engine"
    engine.mkdir(parents=True)
    (engine / "block_manager.py").write_text(
        "from nanovllm.engine.sequence import Sequence\n"
        "from pagedkv.integrations.nanovllm import BlockManager\n")
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "nanovllm_ab.py"
    spec = importlib.util.spec_from_file_location("nanovllm_ab", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--nanovllm", str(tmp_path), "--trace", "azure-conv", "--requests", "12",
                       "--max-output", "8", "--block-sizes", "16", "--repeats", "1",
                       "--pool-tokens", "16384"]) == 0
    out = capsys.readouterr().out
    assert "block size 16, 1,024 blocks" in out and "total" in out
    for name in ("nanovllm", "nanovllm.engine", "nanovllm.engine.sequence"):
        assert name not in sys.modules
    with pytest.raises(SystemExit, match="no nano-vllm block manager"):
        bench.main(["--nanovllm", str(tmp_path / "nowhere")])
