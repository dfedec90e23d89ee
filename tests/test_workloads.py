"""Built-in workloads: published means, quantile tables, clamp, arrivals, sharing knobs, seeds."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.sim.request import Request
from pagedkv.sim.traces import bundled_data_dir, load_azure_csv, trace_path
from pagedkv.sim.workloads import (
    AZURE_QUANTILES,
    BUILTIN_WORKLOADS,
    LOGNORMAL_SPECS,
    arrival_times,
    clamp_request,
    load_workload,
    sample_lengths,
    solve_lognormal_mu,
)

# vLLM paper (SOSP'23) Fig. 11 means, as checks.
PUBLISHED = {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)}
N = 40_000


def lens(reqs):
    return np.array([r.prompt_len for r in reqs]), np.array([r.output_len for r in reqs])


@pytest.mark.parametrize("name", sorted(PUBLISHED))
@pytest.mark.parametrize("max_len", [None, 2048])
def test_means_match_the_paper(name, max_len):
    """Tolerance 2.5%: about 3.5 standard errors of a 40,000-request mean for log-sd 1
    (coefficient of variation sqrt(e - 1) = 1.31, so SE = 1.31 / 200 = 0.66%)."""
    p, o = lens(load_workload(name, N, seed=3, max_len=max_len))
    want_p, want_o = PUBLISHED[name]
    assert p.mean() == pytest.approx(want_p, rel=0.025)
    assert o.mean() == pytest.approx(want_o, rel=0.025)
    if max_len:
        assert (p + o).max() <= max_len


def test_solver_closed_form_without_clamp():
    """Without a clamp, mu = ln(mean) - sigma**2 / 2 up to the rounding to whole tokens."""
    spec = LOGNORMAL_SPECS["sharegpt"]
    mu_p, mu_o = solve_lognormal_mu(spec.prompt_mean, spec.output_mean, 1.0, 1.0, None)
    assert mu_p == pytest.approx(math.log(161.31) - 0.5, abs=0.01)
    assert mu_o == pytest.approx(math.log(337.99) - 0.5, abs=0.01)
    clamped = solve_lognormal_mu(spec.prompt_mean, spec.output_mean, 1.0, 1.0, 2048)
    assert clamped[0] > mu_p and clamped[1] > mu_o  # rejection removes the tail: mu moves up
    with pytest.raises(ValueError, match="cannot fit"):
        solve_lognormal_mu(161.31, 337.99, 1.0, 1.0, 400)
    with pytest.raises(ValueError, match="too tight"):  # reachable only by reshaping the lengths
        load_workload("sharegpt", 10, max_len=700)


@pytest.mark.parametrize("name,median_prompt,median_output", [
    ("azure-conv", 1020, 129), ("azure-code", 1469, 13)])
def test_azure_like_medians(name, median_prompt, median_output):
    """Medians of the data README (1020/129, 1469/13); tolerance 2% or 1 token."""
    p, o = lens(load_workload(name, N, seed=1))
    assert abs(np.median(p) - median_prompt) <= max(1, 0.02 * median_prompt)
    assert abs(np.median(o) - median_output) <= max(1, 0.02 * median_output)


@pytest.mark.parametrize("name", ["azure-conv", "azure-code"])
def test_azure_like_means_match_the_real_trace(name):
    """Tolerance 4%: the piecewise-linear table smooths the heavy tail (measured: 0.8-2.8%)."""
    real_p, real_o = lens(load_azure_csv(trace_path(name, bundled_data_dir())))
    p, o = lens(load_workload(name, N, seed=2))
    assert p.mean() == pytest.approx(real_p.mean(), rel=0.04)
    assert o.mean() == pytest.approx(real_o.mean(), rel=0.04)
    assert np.array_equal(np.percentile(real_p, [0, 50, 100]).round(),
                          np.array(AZURE_QUANTILES[name]["prompt"])[[0, 15, -1]])


@given(name=st.sampled_from(BUILTIN_WORKLOADS), seed=st.integers(0, 2**32),
       max_len=st.sampled_from([None, 1024, 2048]))
def test_deterministic_and_clamped(name, seed, max_len):
    a = load_workload(name, 50, seed=seed, max_len=max_len, rate=3.0)
    assert a == load_workload(name, 50, seed=seed, max_len=max_len, rate=3.0)
    assert all(isinstance(r, Request) and r.prompt_len >= 1 and r.output_len >= 1 for r in a)
    if max_len:
        assert all(r.total_len <= max_len for r in a)
    assert len({r.segments[0][0] for r in a}) == 50  # every prompt's content is its own


def test_seeds_differ_and_keys_do_not_collide():
    a, b = load_workload("sharegpt", 100, seed=0), load_workload("sharegpt", 100, seed=1)
    assert lens(a)[0].tolist() != lens(b)[0].tolist()
    c = load_workload("alpaca", 100, seed=0)
    keys = [r.segments[0][0] for r in a + b + c]
    assert len(set(keys)) == 300


def test_streams_are_independent():
    """Turning on system prompts or arrivals does not change the drawn lengths."""
    plain = load_workload("sharegpt", 200, seed=5)
    other = load_workload("sharegpt", 200, seed=5, rate=2.0, system_prompts=3,
                          system_prompt_len=64, system_prompt_frac=0.5)
    assert [r.output_len for r in plain] == [r.output_len for r in other]
    assert [r.segments[-1] for r in plain] == [r.segments[-1] for r in other]


@pytest.mark.parametrize("process,cv", [("poisson", 1.0), ("gamma", 2.0), ("gamma", 0.5)])
def test_arrival_rates_and_burstiness(process, cv):
    """Mean gap 1/rate within 3%, gap coefficient of variation within 8% (20,000 gaps)."""
    t = arrival_times(20_000, 5.0, np.random.default_rng(0), process, cv)
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)


def test_arrivals_in_workloads_and_traces(tmp_path):
    assert all(r.arrival == 0 for r in load_workload("alpaca", 20))  # offline batch
    reqs = load_workload("alpaca", 2000, seed=0, rate=10.0, arrival="gamma", cv=3.0)
    assert len(reqs) / reqs[-1].arrival == pytest.approx(10.0, rel=0.15)
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,5\n"
                 "2023-11-16 18:15:48.5,20,6\n2023-11-16 18:15:49,30,7\n")
    own = load_workload(p)
    assert [r.arrival for r in own] == [0.0, 2.5, 3.0]
    paced = load_workload(p, rate=100.0, seed=1)
    assert [r.arrival for r in paced] != [0.0, 2.5, 3.0] and paced[-1].arrival < 1
    assert [r.prompt_len for r in load_workload(p, 2, start=1)] == [20, 30]


def test_parallel_sampling_and_beam():
    assert {r.n for r in load_workload("alpaca", 10, n=4)} == {4}
    assert {r.beam_width for r in load_workload("alpaca", 10, beam_width=6)} == {6}
    assert {r.num_seqs for r in load_workload("alpaca", 10, beam_width=6)} == {6}
    with pytest.raises(ValueError, match="not both"):
        load_workload("alpaca", 10, n=2, beam_width=2)


def test_shared_system_prompts():
    """k=4 prompts of 100 tokens for ~30% of requests (binomial tolerance: 4 standard errors)."""
    base = load_workload("sharegpt", 2000, seed=9)
    reqs = load_workload("sharegpt", 2000, seed=9, system_prompts=4, system_prompt_len=100,
                         system_prompt_frac=0.3)
    with_sys = [r for r in reqs if len(r.segments) == 2]
    frac = len(with_sys) / len(reqs)
    assert abs(frac - 0.3) < 4 * math.sqrt(0.3 * 0.7 / 2000)
    assert len({r.segments[0] for r in with_sys}) == 4
    assert all(r.segments[0][1] == 100 for r in with_sys)
    for r, b in zip(reqs, base):
        assert r.prompt_len == b.prompt_len + (100 if len(r.segments) == 2 else 0)
    # The same system prompt is the same tokens at the start of different requests.
    same = [r for r in with_sys if r.segments[0] == with_sys[0].segments[0]][:2]
    assert same[0].prompt_tokens()[:100] == same[1].prompt_tokens()[:100]


def test_clamp_with_system_prompts_and_traces():
    reqs = load_workload("alpaca", 500, seed=2, max_len=400, system_prompts=2,
                         system_prompt_len=200, system_prompt_frac=1.0)
    assert all(r.total_len <= 400 for r in reqs)
    long = Request("x", 0.0, ((1, 3000), (2, 100)), 500)
    cut = clamp_request(long, 2048)
    assert cut.segments == ((1, 2047),) and cut.output_len == 1 and cut.total_len == 2048
    mid = clamp_request(Request("y", 0.0, ((1, 1000), (2, 500)), 900), 2048)
    assert mid.prompt_len == 1500 and mid.output_len == 548
    assert clamp_request(mid, 4096) is mid


@pytest.mark.parametrize("kwargs,match", [
    (dict(name_or_path="sharegpt"), "needs num_requests"),
    (dict(name_or_path="gpt4-chats", num_requests=5), "neither a built-in"),
    (dict(name_or_path="sharegpt", num_requests=5, rate=0), "rate"),
    (dict(name_or_path="sharegpt", num_requests=5, rate=1, arrival="uniform"), "arrival process"),
    (dict(name_or_path="sharegpt", num_requests=5, rate=1, cv=-1), "cv"),
    (dict(name_or_path="sharegpt", num_requests=-1), "num_requests"),
    (dict(name_or_path="sharegpt", num_requests=5, seed=-1), "seed"),
    (dict(name_or_path="sharegpt", num_requests=5, max_len=1), "max_len"),
    (dict(name_or_path="sharegpt", num_requests=5, system_prompt_frac=0.5), "system_prompts >= 1"),
    (dict(name_or_path="sharegpt", num_requests=5, system_prompt_frac=1.5), "system_prompt_frac"),
    (dict(name_or_path="sharegpt", num_requests=5, max_len=100, system_prompts=1,
          system_prompt_len=100, system_prompt_frac=0.5), "below max_len"),
    (dict(name_or_path="sharegpt", num_requests=5, start=3), "trace files only"),
])
def test_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        load_workload(**kwargs)


def test_sample_lengths_errors():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="unknown workload"):
        sample_lengths("lmsys", 5, rng)
    with pytest.raises(ValueError, match="Generator"):
        sample_lengths("alpaca", 5, 0)
    with pytest.raises(ValueError, match="shortest"):
        sample_lengths("azure-code", 5, rng, max_len=8)
    p, o = sample_lengths("alpaca", 0, rng)
    assert len(p) == len(o) == 0


# ---- the length spread: varied over what the real traces show ------------------------------------


@pytest.mark.parametrize("name", sorted(PUBLISHED))
@pytest.mark.parametrize("log_sd", [0.85, 1.36])
def test_log_sd_changes_the_spread_not_the_means(name, log_sd):
    """Same tolerance as the means test (2.5%; the standard error grows with the log-sd: at 1.36,
    CV = sqrt(e**1.85 - 1) = 2.3, SE 1.2%, so 2.5% is still two standard errors)."""
    p, o = lens(load_workload(name, N, seed=5, max_len=2048, log_sd=log_sd))
    want_p, want_o = PUBLISHED[name]
    assert p.mean() == pytest.approx(want_p, rel=0.025) and o.mean() == pytest.approx(want_o, rel=0.025)
    # the spread moves the log-sd of what is drawn (clamp and rounding keep it a little below)
    assert log_sd * 0.8 < np.log(o).std() < log_sd * 1.05
    narrow, _ = lens(load_workload(name, 5000, seed=5, log_sd=0.5))
    wide, _ = lens(load_workload(name, 5000, seed=5, log_sd=1.5))
    assert np.log(wide).std() > 2 * np.log(narrow).std()


def test_log_sd_is_for_lognormal_workloads_only():
    with pytest.raises(ValueError, match="lognormal workloads"):
        load_workload("azure-conv", 10, log_sd=1.0)
    with pytest.raises(ValueError, match="lognormal workloads"):
        sample_lengths("azure-code", 10, np.random.default_rng(0), log_sd=1.0)
    for bad in (0, -1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="log_sd"):
            load_workload("sharegpt", 10, log_sd=bad)
    # the default is the assumed spread, exactly
    assert lens(load_workload("sharegpt", 50, seed=1, log_sd=LOGNORMAL_SPECS["sharegpt"].output_sigma))[0].tolist() \
        == lens(load_workload("sharegpt", 50, seed=1))[0].tolist()


def test_over_limit_share_is_what_the_sampler_redraws():
    from pagedkv.sim.workloads import _SOLVER_SAMPLES, over_limit_share

    share = over_limit_share("sharegpt", 2048)
    assert 0.015 < share < 0.03  # the solver docstring's "2% of draws at 2048"
    assert over_limit_share("sharegpt", 2048, 1.36) > share > over_limit_share("sharegpt", 2048, 0.85)
    assert over_limit_share("alpaca", 2048) * _SOLVER_SAMPLES < 10  # Alpaca almost never exceeds it
    # An independent count: draw from the solved lognormal without the limit and count what exceeds it
    spec = LOGNORMAL_SPECS["sharegpt"]
    mu_p, mu_o = solve_lognormal_mu(spec.prompt_mean, spec.output_mean, 1.0, 1.0, 2048)
    z = np.random.default_rng(11).standard_normal((2, 400_000))
    p = np.maximum(1, np.rint(np.exp(mu_p + z[0])))
    o = np.maximum(1, np.rint(np.exp(mu_o + z[1])))
    assert ((p + o) > 2048).mean() == pytest.approx(share, abs=0.002)  # 3 SE of a 400k-draw share


def test_measured_log_sds_from_the_shipped_traces():
    """Computed from the files, checked against an independent numpy pass over the same files."""
    from pagedkv.sim.workloads import log_sd_range, measured_log_sds

    sds = measured_log_sds()
    assert set(sds) == {"azure-conv", "azure-code", "mooncake"}
    for name in ("azure-conv", "azure-code"):
        a = np.array([(r.prompt_len, r.output_len) for r in load_azure_csv(trace_path(name))], dtype=float)
        assert sds[name][:2] == pytest.approx((np.log(a[:, 0]).std(), np.log(a[a[:, 1] >= 1, 1]).std()))
        assert sds[name][2] == len(a)
    lo, hi = log_sd_range()
    assert lo == min(min(p, o) for p, o, _ in sds.values()) and hi == max(max(p, o) for p, o, _ in sds.values())
    assert 0.8 < lo < LOGNORMAL_SPECS["sharegpt"].output_sigma < hi < 1.4


def test_no_traces_no_spread(tmp_path):
    from pagedkv.sim.workloads import log_sd_range, measured_log_sds

    assert measured_log_sds(tmp_path) == {} and log_sd_range(tmp_path) is None


@pytest.mark.parametrize("call, match", [
    (lambda: arrival_times(3, True, np.random.default_rng(0)), "rate must be None or a finite number > 0"),
    (lambda: arrival_times(3, 1.0, np.random.default_rng(0), "gamma", cv=True), "cv must be a finite number > 0"),
    (lambda: solve_lognormal_mu(True, 10.0, 1.0, 1.0, None), "prompt_mean must be a finite number > 0"),
])
def test_number_arguments_refuse_bools(call, match):
    """``rate=True`` is a bug, not one request per second: every number argument refuses bools
    (pagedkv.checks' rule), as the int arguments always did."""
    with pytest.raises(ValueError, match=match):
        call()


def test_system_prompt_fraction_refuses_a_bool():
    with pytest.raises(ValueError, match=r"system_prompt_frac must be in \[0, 1\], got True"):
        load_workload("sharegpt", 4, system_prompts=1, system_prompt_len=8, system_prompt_frac=True)
