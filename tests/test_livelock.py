"""Where the scheduler livelocks: each failure mode happens with its guard off, and with the
guards on every request finishes or is reported.

Exact expectations where the construction fixes them (which victims the first step of the
fork case preempts, the start-up refusal's numbers, the freeable-block counts); relational ones
(fewer preemptions with a watermark) where only the direction is the claim, on seeded
deterministic workloads. Times come from ``FREE`` (about one second per iteration) or the
default cost model; nothing here measures wall time.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.cli import main
from pagedkv.report import SECTIONS
from pagedkv.report import livelock as section_mod
from pagedkv.report.options import ReportOptions
from pagedkv.sim.baselines import PagedAllocator, ReservationAllocator, make_allocator
from pagedkv.sim.costmodel import CostModel
from pagedkv.sim.metrics import tail_latency
from pagedkv.sim.request import Request
from pagedkv.sim.samples import SampleAllocator, split_samples
from pagedkv.sim.scheduler import (GUARD_NAMES, Guards, Livelock, check_fits, freeable_blocks,
                                   simulate)
from pagedkv.report.tables import TEXT_WIDTH

FREE = CostModel(kv_bytes_per_token=1, weight_bytes=0, overhead_s=1.0)  # every iteration: ~1 s


def req(rid, prompt, output, arrival=0.0, key=None, **kw):
    return Request(rid, arrival, ((key if key is not None else hash(rid) & 0xFFFF, prompt),), output, **kw)


class SpySamples(SampleAllocator):
    """Records every release with the blocks the manager would free at that moment."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.released = []

    def release(self, req_id):
        self.released.append((req_id, freeable_blocks(self, req_id)))
        super().release(req_id)


# ---- guards, the start-up check, freeable blocks ---------------------------------------------


def test_guard_defaults_are_vllm_v1_and_switch_one_at_a_time():
    g = Guards()
    assert [g.is_on(n) for n in GUARD_NAMES] == [True, True, True, False, False]
    assert g.describe() == "newest_first, no_admit_after_preempt, fit_check"
    on = Guards.all_on()
    assert all(on.is_on(n) for n in GUARD_NAMES) and on.watermark == 0.05
    assert Guards.all_off().describe() == "none"
    assert on.switched("watermark", False).watermark == 0.0
    assert Guards.all_off().switched("watermark", True, 0.02).describe() == "watermark 0.02"
    assert not on.switched("newest_first", False).newest_first
    for bad in ({"newest_first": 1}, {"fit_check": None}, {"watermark": 1.0}, {"watermark": -0.1},
                {"watermark": True}):
        with pytest.raises(ValueError):
            Guards(**bad)
    with pytest.raises(ValueError, match="unknown guard"):
        on.switched("patience", True)


def test_start_up_refuses_a_request_longer_than_the_cache_and_names_the_numbers():
    alloc = PagedAllocator(8, 4)  # 32 slots
    reqs = [req("long", 100, 5), req("short", 4, 2)]
    with pytest.raises(ValueError) as e:
        simulate(reqs, alloc, FREE)
    msg = str(e.value)
    for needle in ("request long", "105 tokens", "27 blocks of 4", "32 slots", "8 blocks", "27 blocks",
                   "max_len <= 32", "(now 2,048)", "runs into a livelock"):
        assert needle in msg, needle
    assert alloc.usage().used_blocks == 0 and alloc.usage().prefix_query_tokens == 0  # nothing ran
    # clipped to a max_len that fits, it runs (the operator's fix the message suggests)
    res = simulate(reqs, PagedAllocator(8, 4), FREE, max_len=32)
    assert res.clipped == 1 and res.finished == 2 and res.completed
    # reservations are checked on their slots as well
    with pytest.raises(ValueError, match="holds 32 slots"):
        simulate(reqs, ReservationAllocator(32, "oracle", 2048), FREE)
    check_fits([], alloc, 2048)  # nothing to check


def test_freeable_blocks_counts_only_the_blocks_a_victim_alone_holds():
    a = SampleAllocator(20, 16)
    samples = split_samples([req("G", 40, 10, key=5, n=4)])
    assert [r.req_id for r in samples] == ["G/0", "G/1", "G/2", "G/3"]
    for r in samples:
        assert a.admit(r)
    assert a.forks == 3 and a.m.num_free_blocks == 17  # one prompt of 3 blocks, shared 4 ways
    assert [freeable_blocks(a, r.req_id) for r in samples] == [0, 0, 0, 0]
    a.step([r.req_id for r in samples])
    assert a.copies == 3  # the shared partial block, copied for all but its last holder
    assert [freeable_blocks(a, r.req_id) for r in samples] == [1, 1, 1, 1]
    a.check()
    # a group kept together frees every block of its own, shared among its samples or not
    p = PagedAllocator(20, 16)
    assert p.admit(req("K", 40, 10, key=6, n=4))
    assert p.seq_ids("K") == ["K.0", "K.1", "K.2", "K.3"]
    assert freeable_blocks(p, "K") == 3
    r = ReservationAllocator(64, "oracle", 64)
    assert r.admit(req("R", 10, 10)) and freeable_blocks(r, "R") is None  # a range: always frees


def test_sample_allocator_forks_only_a_fresh_identical_prompt_and_recomputes_from_the_cache():
    a = SampleAllocator(40, 4)
    assert a.admit(req("x", 10, 5, key=1))
    a.step(["x"])  # x has produced a token: no longer fresh
    assert a.admit(req("y", 10, 5, key=1)) and a.forks == 0
    assert a.last_hit_tokens == 8  # the two full blocks, from the prefix cache
    assert a.admit(req("z", 10, 5, key=1)) and a.forks == 1 and a.last_hit_tokens == 10  # y is fresh
    assert a.m.block_table("z.0") == a.m.block_table("y.0")
    a.step(["x", "y", "z"])
    a.release("x")  # preempted at 12 tokens: its full blocks stay cached
    # recomputed with its first generated token (11 tokens): the two blocks before the last token hit
    assert a.admit(req("x", 10, 5, key=1), generated=1) and a.last_hit_tokens == 8
    assert a.admit(req("g", 6, 3, key=2, n=3)) and a.num_seqs("g") == 3 and a.seq_ids("g") == ["g.0", "g.1", "g.2"]
    a.check()
    for bad in (req("b", 4, 2, beam_width=2), req("g", 4, 2)):
        with pytest.raises(ValueError):
            a.admit(bad)
    with pytest.raises(ValueError):
        a.admit(req("n", 4, 2, n=2), generated=1)
    with pytest.raises(ValueError):
        split_samples([req("b", 4, 2, beam_width=2)])
    free = a.m.num_free_blocks
    assert not a.admit(req("big", 4 * free + 4, 1))  # refused, nothing changed
    assert a.m.num_free_blocks == free
    a.check()


def test_sample_allocator_runs_distinct_prompts_exactly_as_the_paged_allocator():
    """Without identical prompts to fork, the section's allocator is PagedAllocator without its
    watermark: the same admissions, steps, preemptions and cache contents."""
    reqs = section_mod.thrash_workload(12, 3, long_output=False)
    reqs += [req(f"k{i}", 30 + i, 60, key=900 + i, n=3) for i in range(4)]
    allocators = (SampleAllocator(60, 16), PagedAllocator(60, 16, watermark=0.0))
    a, b = (simulate(reqs, alloc, FREE) for alloc in allocators)
    assert a.preemptions == b.preemptions > 0 and a.recomputed_tokens == b.recomputed_tokens
    assert np.array_equal(a.steps.slots, b.steps.slots) and np.array_equal(a.steps.tokens, b.steps.tokens)
    assert a.usage == b.usage


# ---- (a) thrashing ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thrash_runs():
    reqs = section_mod.thrash_workload(16, 0, long_output=False)
    out = {}
    for label, g in (("v1", Guards()), ("readmit", Guards(no_admit_after_preempt=False)),
                     ("wm2", Guards(watermark=0.02)), ("wm5", Guards(watermark=0.05))):
        out[label] = section_mod.serve(reqs, 100, 16, g, CostModel())
    return out


def test_thrashing_preempts_the_same_requests_again_and_again(thrash_runs):
    v1 = thrash_runs["v1"]
    assert v1.completed and v1.finished == 16
    assert v1.requests.preemptions.max() >= 4  # one request preempted four times or more
    assert (v1.requests.preemptions >= 2).sum() >= 5
    assert v1.recomputed_tokens > 0
    # readmitting right after a preemption: more preemptions, and of the same requests
    readmit = thrash_runs["readmit"]
    assert readmit.preemptions > v1.preemptions
    assert readmit.requests.preemptions.max() > v1.requests.preemptions.max()
    assert readmit.recomputed_tokens > v1.recomputed_tokens


def test_watermark_cuts_preemptions_and_recomputation(thrash_runs):
    counts = [thrash_runs[k].preemptions for k in ("v1", "wm2", "wm5")]
    assert counts[0] > counts[1] > counts[2]
    assert thrash_runs["wm5"].recomputed_tokens < thrash_runs["v1"].recomputed_tokens
    assert all(r.completed for r in thrash_runs.values())


def test_watermark_guard_keeps_blocks_free_at_admission_but_not_for_the_first():
    # 20 blocks of 4; a 5% watermark is 1 block. r0 takes 19 blocks (the last one partial, so its
    # token needs none); r1 (3 tokens, 1 block) would leave 0 free
    reqs = [req("r0", 75, 1), req("r1", 3, 1)]
    res = simulate(reqs, SampleAllocator(20, 4), FREE, guards=Guards(watermark=0.05))
    assert res.steps.running[:1].tolist() == [1]  # r1 waited although its block was free
    assert res.steps.blocked[0]
    assert res.finished == 2
    res = simulate(reqs, SampleAllocator(20, 4), FREE)
    assert res.steps.running[:1].tolist() == [2]
    alone = simulate([req("big", 80, 0)], SampleAllocator(20, 4), FREE, guards=Guards(watermark=0.5))
    assert alone.finished == 1  # nothing running: the watermark does not apply


# ---- (b) a request that can never fit --------------------------------------------------------


def test_a_request_longer_than_the_cache_livelocks_and_blocks_the_queue_without_the_fit_check():
    reqs, blocks = section_mod.never_fits_case(16, samples=False)
    with pytest.raises(Livelock) as e:
        simulate(reqs, SampleAllocator(blocks, 16, enable_prefix_caching=False), CostModel(), max_len=4096,
                 guards=Guards(fit_check=False))
    res = e.value.result
    assert not res.completed and res.livelock == str(e.value)
    assert "livelock: no request progressed" in res.livelock and "head of the queue long" in res.livelock
    assert res.finished == 0 and res.dropped == 0  # the three small ones never ran
    log = res.requests
    assert log.preemptions.tolist() == [res.preemptions, 0, 0, 0]  # the head, over and over
    assert np.isnan(log.first_token[1:]).all()
    # it runs out at 24 full blocks; each readmission prefills all 384 tokens again, and the
    # run stops with it preempted once more
    assert res.recomputed_tokens == 24 * 16 * (res.preemptions - 1)


def test_a_group_that_outgrows_the_cache_restarts_for_ever_without_the_fit_check():
    reqs, blocks = section_mod.never_fits_case(16, samples=True)
    res = simulate(reqs, SampleAllocator(blocks, 16), CostModel(), max_len=4096,
                   guards=Guards(fit_check=False), on_livelock="return")
    assert not res.completed and res.finished == 3  # it restarts small and lets them pass
    log = res.requests
    assert np.isnan(log.finish[0]) and log.preemptions[0] >= 10
    assert res.discarded_tokens > 0


def test_the_fit_check_refuses_a_long_request_and_drops_a_group_that_outgrows_the_cache():
    reqs, blocks = section_mod.never_fits_case(16, samples=False)
    with pytest.raises(ValueError, match="request long needs 512 tokens"):
        simulate(reqs, SampleAllocator(blocks, 16), CostModel(), max_len=4096)
    reqs, blocks = section_mod.never_fits_case(16, samples=True)
    alloc = SampleAllocator(blocks, 16)
    res = simulate(reqs, alloc, CostModel(), max_len=4096)
    assert res.completed and res.dropped_ids == ("wide",) and res.finished == 3
    alloc.check()
    assert alloc.usage().used_blocks == 0


# ---- (c) victims that free nothing -----------------------------------------------------------


def first_step_releases(skip):
    reqs, blocks = section_mod.futile_case(16)
    alloc = SpySamples(blocks, 16, enable_prefix_caching=False)
    res = simulate(reqs, alloc, FREE, max_iterations=1, guards=Guards(skip_unfreeing=skip), on_livelock="return")
    return alloc.released, res


def test_fresh_forks_free_nothing_and_cascade_without_the_guard():
    released, res = first_step_releases(skip=False)
    # newest first: the seven forks (nothing to free), then their parent (its 3 blocks)
    assert released == [(f"G/{i}", 0) for i in range(7, 0, -1)] + [("G/0", 3)]
    assert res.futile_preemptions == 7 and res.preemptions == 8
    assert res.steps.tokens.tolist() == [2]  # only A and B decoded


def test_skipping_victims_that_free_nothing_preempts_one_request():
    released, res = first_step_releases(skip=True)
    assert released == [("B", 12)]
    assert res.futile_preemptions == 0 and res.skipped_victims == 8 and res.preemptions == 1
    assert res.steps.tokens.tolist() == [9]  # A and all eight samples


def test_futile_preemptions_over_a_whole_run():
    reqs, blocks = section_mod.futile_case(16)
    off = section_mod.serve(reqs, blocks, 16, Guards(), FREE)
    on = section_mod.serve(reqs, blocks, 16, Guards(skip_unfreeing=True), FREE)
    assert off.completed and on.completed and off.finished == on.finished == len(reqs)
    assert off.futile_preemptions >= 7 and on.futile_preemptions == 0
    assert on.preemptions < off.preemptions and on.iterations < off.iterations


# ---- (d) oldest first ------------------------------------------------------------------------


def test_preempting_the_oldest_first_restarts_the_groups_for_ever():
    reqs, blocks = section_mod.pingpong_case(16)
    with pytest.raises(Livelock) as e:
        simulate(reqs, SampleAllocator(blocks, 16, enable_prefix_caching=False), FREE,
                 guards=Guards(newest_first=False))
    res = e.value.result
    assert res.finished == 0 and res.discarded_tokens > 0
    assert sorted(res.requests.preemptions.tolist())[0] >= 2  # both restarted, in turn
    res = simulate(reqs, SampleAllocator(blocks, 16, enable_prefix_caching=False), FREE)
    assert res.completed and res.finished == 2


# ---- livelock detection ----------------------------------------------------------------------


def test_livelock_is_raised_or_returned_and_the_iteration_cap_is_one():
    reqs = [req("long", 20, 100)]  # 120 tokens on 100 slots
    alloc = lambda: SampleAllocator(25, 4)  # noqa: E731
    with pytest.raises(Livelock, match="no request progressed for 7 iterations"):
        simulate(reqs, alloc(), FREE, guards=Guards(fit_check=False), stall_limit=7)
    res = simulate(reqs, alloc(), FREE, guards=Guards(fit_check=False), stall_limit=7, on_livelock="return")
    assert not res.completed and res.finished == 0 and res.preemptions > 0
    assert res.iterations == res.steps.running.size  # no idle step
    with pytest.raises(Livelock, match="did not finish within 10 iterations"):
        simulate([req("ok", 4, 50)], alloc(), FREE, max_iterations=10)
    assert issubclass(Livelock, ValueError)  # the old iteration cap raised ValueError
    for bad in ({"on_livelock": "ignore"}, {"stall_limit": 0}, {"guards": "all"}):
        with pytest.raises(ValueError):
            simulate(reqs, alloc(), FREE, **bad)


def test_request_log_and_tail_latency_on_the_docstring_example():
    reqs = [req(f"r{i}", 1, 2) for i in range(3)]
    res = simulate(reqs, ReservationAllocator(8, "max", max_len=4), FREE, max_len=4)
    log = res.requests
    assert log.ids == ["r0", "r1", "r2"]
    t = np.cumsum(res.steps.dt)  # iteration ends
    assert log.first_token.tolist() == pytest.approx([t[0], t[0], t[2]], rel=1e-12)
    assert log.finish.tolist() == pytest.approx([t[1], t[1], t[3]], rel=1e-12)
    lat = tail_latency(res, (50, 99))
    assert lat["latency_p50"] == pytest.approx(t[1]) and lat["latency_p99"] == pytest.approx(t[3])
    assert lat["ttft_p99"] == pytest.approx(t[2])
    with pytest.raises(ValueError):
        tail_latency("run")


def test_tail_latency_counts_a_request_that_never_finished_as_infinitely_late():
    reqs, blocks = section_mod.never_fits_case(16, samples=True)  # 3 small ones finish, "wide" never
    res = simulate(reqs, SampleAllocator(blocks, 16), FREE, max_len=4096, guards=Guards(fit_check=False),
                   on_livelock="return")
    log = res.requests
    assert res.finished == 3 and np.isnan(log.finish[0])
    lat = tail_latency(res)
    done = np.sort(log.finish[1:] - log.arrival[1:])
    assert lat["latency_p50"] == done[1]  # nearest rank: the 2nd of 4
    assert lat["latency_p90"] == lat["latency_p99"] == float("inf")
    assert lat["ttft_p99"] < float("inf")  # it did produce tokens


# ---- with the guards, every request finishes or is reported -----------------------------------


def group_peak_blocks(r: Request, bs: int) -> int:
    """Blocks an n-sample group holds at its end: the prompt's full blocks once, the rest per
    sample (each copies the shared partial block at its first token; with no token to generate,
    the samples share everything)."""
    if r.output_len == 0:
        return -(-r.prompt_len // bs)
    full = r.prompt_len // bs
    return full + r.num_seqs * (-(-r.total_len // bs) - full)


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    blocks = draw(st.integers(2, 40))
    reqs = []
    for i in range(draw(st.integers(1, 7))):
        prompt = draw(st.integers(1, 3 * blocks * bs // 2))  # some longer than the cache
        output = draw(st.integers(0, 30))
        kind = draw(st.sampled_from(["single", "n", "beam", "shared"]))
        width = draw(st.integers(2, 4))
        key = 7 if kind == "shared" else 100 + i  # shared: identical prompts (forks)
        arrival = draw(st.sampled_from([0.0, 0.0, 1.5, 7.0]))
        kw = {"n": width} if kind == "n" else {"beam_width": width} if kind == "beam" else {}
        reqs.append(Request(f"r{i}", arrival, ((key, prompt),), output, **kw))
    return bs, blocks, reqs


def serve_guarded(alloc, reqs, bs, blocks, guards, max_num_seqs):
    longest = max(reqs, key=lambda r: r.total_len)
    if -(-longest.total_len // bs) > blocks:
        with pytest.raises(ValueError, match=f"request {longest.req_id} needs"):
            simulate(reqs, alloc, FREE, max_len=10_000, guards=guards, max_num_seqs=max_num_seqs)
        return None
    res = simulate(reqs, alloc, FREE, max_len=10_000, guards=guards, max_num_seqs=max_num_seqs)
    assert res.completed, res.livelock
    assert res.finished + res.dropped == len(reqs)
    alloc.check()
    assert alloc.usage().used_blocks == 0
    return res


@given(workloads(), st.sampled_from(["v1", "all"]), st.booleans(), st.integers(1, 12))
def test_with_the_guards_every_request_finishes_or_is_reported_paged(w, which, caching, max_num_seqs):
    bs, blocks, reqs = w
    guards = Guards() if which == "v1" else Guards.all_on()
    alloc = PagedAllocator(blocks, bs, enable_prefix_caching=caching, watermark=0.0)
    res = serve_guarded(alloc, reqs, bs, blocks, guards, max_num_seqs)
    if res is None:
        return
    never = {r.req_id for r in reqs if r.beam_width == 1 and group_peak_blocks(r, bs) > blocks}
    bound = {r.req_id for r in reqs if group_peak_blocks(r, bs) > blocks}  # beams may share more
    assert never <= set(res.dropped_ids) <= bound


@given(workloads(), st.sampled_from(["v1", "all"]), st.booleans(), st.booleans(), st.integers(1, 12))
def test_with_the_guards_every_request_finishes_or_is_reported_samples(w, which, caching, split, max_num_seqs):
    bs, blocks, reqs = w
    reqs = [Request(r.req_id, r.arrival, r.segments, r.output_len, n=max(r.n, r.beam_width)) for r in reqs]
    if split:
        reqs = split_samples(reqs)
    guards = Guards() if which == "v1" else Guards.all_on()
    alloc = SampleAllocator(blocks, bs, enable_prefix_caching=caching)
    res = serve_guarded(alloc, reqs, bs, blocks, guards, max_num_seqs)
    if res is None:
        return
    assert set(res.dropped_ids) == {r.req_id for r in reqs if group_peak_blocks(r, bs) > blocks}
    assert res.output_tokens == sum(r.output_len * r.num_seqs for r in reqs if r.req_id not in res.dropped_ids)


def test_reservation_baselines_with_all_guards_finish():
    reqs = [req(f"r{i}", 10 + i, 20) for i in range(6)]
    for name in ("max", "pow2", "oracle"):
        res = simulate(reqs, make_allocator(name, 8, 16, max_len=64), FREE, max_len=64, guards=Guards.all_on())
        assert res.completed and res.finished == 6 and res.preemptions == 0


# ---- the command line ----------------------------------------------------------------------


def test_simulate_command_takes_the_guards(capsys):
    args = ["simulate", "alpaca", "--n", "4", "--num-requests", "30", "--kv-gib", "0.1", "--allocator", "paged",
            "--rate", "0", "--model", "Llama-3.1-8B"]  # 0.1 GiB: 819 of its tokens
    assert main(args + ["--guards", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pagedkv simulate: error: livelock: no request progressed")
    assert main(args + ["--guards", "all"]) == 0
    assert "preemptions" in capsys.readouterr().out
    assert main(["simulate", "sharegpt", "--num-requests", "20", "--kv-gib", "0.01", "--allocator", "paged",
                 "--model", "Llama-3.1-8B"]) == 2
    err = capsys.readouterr().err
    # 0.01 GiB holds 80 tokens: the default context limit, too short for ShareGPT's lengths
    assert "do not fit a context limit of 80 tokens (what the KV cache holds" in err and "Traceback" not in err
    assert main(["simulate", "sharegpt", "--num-requests", "20", "--kv-gib", "0.01", "--allocator", "paged",
                 "--model", "Llama-3.1-8B", "--max-len", "2048"]) == 2
    err = capsys.readouterr().err
    assert "needs 1,891 tokens, 119 blocks of 16, but the KV cache of paged holds 5 blocks: it could never run" in err


# ---- the report section ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_section():
    return section_mod.section(ReportOptions(quick=True))


def test_section_is_registered_and_fits_a_terminal(quick_section):
    sec = quick_section
    assert SECTIONS["livelock"] == "livelock" and sec.key == "livelock"
    assert len(sec.tables) == 3
    assert all(len(line) <= TEXT_WIDTH for line in sec.to_text().splitlines())
    with pytest.raises(ValueError):
        section_mod.section({"quick": True})


def test_section_shows_each_guard_matters(quick_section):
    data = quick_section.data
    abl = data["ablation"]
    assert abl["all on"]["completed"] and not abl["all off"]["completed"]
    assert abl["all on"]["preemptions"] < abl["all off"]["preemptions"]
    assert not abl["all on but fit check"]["completed"]
    modes = data["modes"]
    for case, guard in (("(b) 8 samples outgrowing the cache", "fit check"),
                        ("(d) oldest first, 2-sample groups", "newest first")):
        assert modes[f"{case} | {guard} off"].startswith("livelock")
        assert modes[f"{case} | {guard} on"].startswith("completed")
    assert modes["(b) request longer than the cache | fit check on"] == "refused at start-up"
    thrash = data["thrash"]
    counts = [thrash[k]["preemptions"] for k in ("vLLM v1 (no watermark)", "watermark 2%", "watermark 5%")]
    assert counts[0] > counts[1] > counts[2]
    table = quick_section.tables[1]
    futile = dict(zip(table.column("guard"), table.column("victims freeing nothing")))
    assert futile["skip victims freeing nothing off"] > 0 and futile["skip victims freeing nothing on"] == 0
