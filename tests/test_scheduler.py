"""The serving scheduler, the cost model and the metrics.

Tolerances: iteration counts, tokens and slots are exact; times are floats compared with
``pytest.approx`` at relative 1e-9 (pure arithmetic, no measurement).
"""
from __future__ import annotations

import io

import numpy as np
import pytest

from pagedkv.sim.baselines import PagedAllocator, ReservationAllocator, make_allocator
from pagedkv.sim.costmodel import CostModel
from pagedkv.sim.metrics import compute, time_weighted_shares, window_mask
from pagedkv.sim.request import Request
from pagedkv.sim.scheduler import Progress, StepLog, clip_request, simulate

FREE = CostModel(kv_bytes_per_token=1, weight_bytes=0, overhead_s=1.0)  # every iteration: ~1 s


def req(i, prompt, output, arrival=0.0, **kw):
    return Request(f"r{i}", arrival, ((500 + i, prompt),), output, **kw)


def test_docstring_example_three_requests_room_for_two():
    reqs = [req(i, 1, 2) for i in range(3)]
    res = simulate(reqs, ReservationAllocator(8, "max", max_len=4), FREE, max_len=4)
    s = res.steps
    assert len(s) == 4 and s.tokens.tolist() == [2, 2, 1, 1]
    assert res.finished == 3 and res.output_tokens == 6
    assert s.blocked.tolist() == [True, True, False, False]
    assert (s.slots.sum(axis=1) == 8).all()


def test_arrivals_are_respected_and_idle_gaps_recorded():
    reqs = [req(0, 4, 2, arrival=0.0), req(1, 4, 2, arrival=100.0)]
    res = simulate(reqs, make_allocator("oracle", 4, 16), FREE)
    s = res.steps
    assert s.idle.sum() == 1
    gap = np.flatnonzero(s.idle)[0]
    assert s.t[gap + 1] == pytest.approx(100.0)  # r1 admitted no earlier than it arrived
    assert res.makespan == pytest.approx(100.0 + 2 * FREE.overhead_s, rel=1e-6)  # 2 steps of ~1 s
    assert compute(res, "all").shares["free"] > 0.9


def test_fcfs_head_blocks_smaller_followers():
    # 64 slots, Oracle placed exactly (no buddy rounding): r0 (40) runs; r1 (40) cannot fit and
    # must block r2 (4), which would fit in the 24 slots left
    reqs = [req(0, 30, 10), req(1, 30, 10), req(2, 2, 2)]
    res = simulate(reqs, ReservationAllocator(64, "oracle", 64, exact=True), FREE, max_len=64)
    s = res.steps
    assert s.running[:10].tolist() == [1] * 10  # r2 never jumped the queue
    assert s.blocked[0] and s.category("external_fragmentation")[0] == 24  # 24 free slots, need 64-block
    assert res.finished == 3


def test_paged_preemption_by_recompute_finishes_everything():
    reqs = [req(i, 20, 30) for i in range(6)]
    alloc = PagedAllocator(30, 4, watermark=0.0)  # 120 slots; six 50-token requests cannot coexist
    res = simulate(reqs, alloc, FREE)
    assert res.preemptions > 0
    assert res.finished == 6 and res.dropped == 0
    assert res.output_tokens == 6 * 30
    alloc.check()
    assert alloc.usage().used_blocks == 0
    assert (res.steps.slots.sum(axis=1) == 120).all()
    assert res.usage.prefix_hit_tokens > 0  # resumed requests found their own blocks again


class SpyPaged(PagedAllocator):
    """Records the order of successful admissions and of releases."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log = []

    def admit(self, req, generated=0):
        ok = super().admit(req, generated)
        if ok:
            self.log.append(("admit", req.req_id, generated))
        return ok

    def release(self, req_id):
        self.log.append(("release", req_id, self._reqs[req_id].length))
        super().release(req_id)


def test_preempted_request_goes_back_to_the_front_and_resumes():
    # 14 blocks of 4: r0 and r1 start with 2 blocks each and grow to 8; r2 (11 blocks) waits
    reqs = [req(0, 8, 24), req(1, 8, 24), req(2, 44, 1)]
    alloc = SpyPaged(14, 4, watermark=0.0)
    res = simulate(reqs, alloc, FREE)
    assert res.preemptions >= 1 and res.finished == 3
    admits = [(rid, g) for kind, rid, g in alloc.log if kind == "admit"]
    first_release = next(i for i, e in enumerate(alloc.log) if e[0] == "release")
    victim = alloc.log[first_release][1]
    assert victim == "r1"  # the most recently admitted request is preempted
    later = [e for e in alloc.log[first_release:] if e[0] == "admit"]
    assert later[0][1] == "r1" and later[0][2] > 0  # back at the front, resuming its progress
    assert admits.index(later[0][1:]) < admits.index(("r2", 0))  # ahead of r2


def test_requests_that_never_fit_are_refused_or_dropped():
    # one sequence longer than the whole cache: refused before the run (the fit check)
    reqs = [req(0, 100, 5), req(1, 4, 2)]
    with pytest.raises(ValueError, match="request r0 needs 105 tokens"):
        simulate(reqs, PagedAllocator(8, 4), FREE, max_len=2048)
    with pytest.raises(ValueError, match="holds 32 slots"):
        simulate(reqs, ReservationAllocator(32, "oracle", 2048), FREE)
    # four samples that fit one at a time but not together: dropped when alone, and named
    reqs = [req(0, 4, 20, n=4), req(1, 4, 2)]
    res = simulate(reqs, PagedAllocator(8, 4), FREE)
    assert (res.dropped, res.finished, res.dropped_ids) == (1, 1, ("r0",))
    # a reservation that cannot be placed even in empty memory: dropped too (Max reserves 64)
    res = simulate([req(0, 4, 2), req(1, 4, 2)], ReservationAllocator(32, "max", 64), FREE, max_len=64)
    assert (res.dropped, res.finished) == (2, 0) and res.completed


def test_max_num_seqs_caps_the_batch():
    reqs = [req(i, 4, 5, n=2) for i in range(10)]
    res = simulate(reqs, PagedAllocator(200, 4), FREE, max_num_seqs=4)
    assert res.steps.batch.max() == 4 and res.finished == 10


def test_clip_request():
    r = Request("x", 0.0, ((1, 2000), (2, 1000)), 100)
    c = clip_request(r, 2048)
    assert c.prompt_len == 2047 and c.output_len == 1 and c.segments[0] == (1, 2000)
    assert clip_request(req(0, 10, 10), 2048) is not None
    with pytest.raises(ValueError):
        clip_request(r, 1)
    res = simulate([r], make_allocator("max", 200, 16), FREE)
    assert res.clipped == 1 and res.finished == 1


def test_simulate_validates():
    with pytest.raises(ValueError):
        simulate([req(0, 1, 1)], "paged")
    with pytest.raises(ValueError):
        simulate([req(0, 1, 1), req(0, 2, 2)], make_allocator("max", 200, 16))
    with pytest.raises(ValueError):
        simulate([req(0, 1, 1)], make_allocator("max", 200, 16), max_num_seqs=0)


def test_cost_model_formula_and_worked_number():
    c = CostModel()  # Llama-3.1-8B from the sizing module, H100 defaults
    assert c.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert c.step_time(16_000) == pytest.approx(1e-3 + (c.weight_bytes + 16_000 * 131_072) / 3.35e12, rel=1e-9)
    assert round(c.step_time(16_000) * 1e3, 2) == 6.42  # the docstring's worked number
    pre = c.step_time(0, prefill_tokens=100, decoding=False)
    assert pre == pytest.approx(1e-3 + 100 * 2 * c.weight_bytes / 2 / 989e12, rel=1e-9)
    assert c.step_time(0, 0, decoding=False) == 0.0
    assert CostModel.for_model("OPT-13B").kv_bytes_per_token == 819_200
    for bad in ({"bandwidth": 0}, {"overhead_s": -1}, {"kv_bytes_per_token": 0}, {"peak_flops": float("nan")}):
        with pytest.raises(ValueError):
            CostModel(**bad)
    with pytest.raises(ValueError):
        c.step_time(-1)


def test_time_weighting_worked_example():
    n = 2
    steps = StepLog(t=np.array([0.0, 0.01]), dt=np.array([0.01, 0.03]), batch=np.ones(n, int),
                    running=np.ones(n, int), tokens=np.ones(n, int), prefill=np.zeros(n, int),
                    kv_read=np.ones(n, int), waiting=np.ones(n, bool), blocked=np.zeros(n, bool),
                    idle=np.zeros(n, bool), slots=np.array([[40, 0, 0, 0, 60], [60, 0, 0, 0, 40]]),
                    logical_blocks=np.zeros(n, int), saved_blocks=np.zeros(n, int))
    shares = time_weighted_shares(steps, 100, window_mask(steps, "saturated"))
    assert shares["token_states"] == pytest.approx(0.55, rel=1e-12)
    assert sum(shares.values()) == pytest.approx(1.0, rel=1e-12)
    with pytest.raises(ValueError):
        window_mask(steps, "weekly")


def test_metrics_on_a_run():
    reqs = [req(i, 30, 20) for i in range(20)]
    res = simulate(reqs, PagedAllocator(40, 16, enable_prefix_caching=False), FREE)
    m = compute(res)
    assert m.finished == 20 and m.throughput_rps == pytest.approx(20 / res.makespan)
    assert m.tokens_per_s == pytest.approx(400 / res.makespan)
    assert sum(m.shares.values()) == pytest.approx(1.0, rel=1e-12)
    assert 0 < m.internal_fragmentation_ratio < 0.5 and m.avg_batch > 1
    assert m.block_table_bytes_per_seq > 4 * 2  # at least ceil(31/16) entries of 4 bytes
    with pytest.raises(ValueError):
        compute("run")


def test_progress_bar_plain_text_and_off_by_default():
    buf = io.StringIO()
    p = Progress(10, "paged", stream=buf, interval=0.0)
    p.update(5, "t=1s")
    p.close(10)
    out = buf.getvalue()
    assert "[###############...............]  50% 5/10" in out and out.endswith("\n")
    quiet = io.StringIO()
    Progress(10, stream=quiet, enabled=False).update(5)
    assert quiet.getvalue() == ""


def test_progress_flag_draws_on_stderr(capsys):
    simulate([req(0, 4, 3)], make_allocator("paged", 10, 4), FREE, progress=True)
    assert "100% 1/1" in capsys.readouterr().err
    simulate([req(0, 4, 3)], make_allocator("paged", 10, 4), FREE)
    assert capsys.readouterr().err == ""
