"""Workloads: the request streams the simulator and the report replay.

Built-in synthetic workloads need no files; real traces load from files (``traces.py``).

- **ShareGPT-like** and **Alpaca-like**: prompt and output lengths are independent lognormals.
  The published figures are only the means (vLLM paper, SOSP'23, section 6.1 / Fig. 11: ShareGPT
  161.31 prompt / 337.99 output tokens, Alpaca 19.31 / 58.45), so the spread is a stated
  assumption (``LOGNORMAL_SPECS``: log-sd 1.0 for ShareGPT, close to the 0.99 / 0.86 measured on
  the real Azure conversation trace; 0.8 for Alpaca's short, uniform instructions) and the
  location ``mu`` is *solved* so that the lengths actually produced (rounded, at least 1, and
  resampled when ``prompt + output > max_len``) have the published means. With log-sd 1 and no
  clamp, ``mu = ln(mean) - 1/2``: ShareGPT prompts have median ``161.31 / e**0.5 = 97.8``.
- **Azure-conversation-like** and **Azure-code-like**: lengths drawn by inverse CDF from the
  percentile tables below (piecewise-linear between percentiles), measured on the real Azure LLM
  inference traces of 2023. Prompt and output are drawn independently (their measured
  log-correlation is 0.09 for conversation, 0.00 for code).

Arrivals: all at t = 0 (``rate=None``, an offline batch), a Poisson process, or a Gamma renewal
process (``arrival="gamma"``) whose inter-arrival coefficient of variation ``cv`` > 1 makes bursts
(``cv=1`` is Poisson); a trace keeps its own timestamps unless a rate is given.

Everything is drawn from ``numpy.random.Generator``s spawned from one ``seed``, one stream per
concern (lengths, arrivals, system prompts), so changing e.g. the system-prompt fraction does not
change the lengths.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..checks import int_at_least, number_at_least
from .request import Request
from .traces import TRACE_FILES, content_key, default_data_dir, load_trace, trace_lengths, trace_path

__all__ = [
    "BUILTIN_WORKLOADS",
    "ARRIVALS",
    "MIN_ACCEPTANCE",
    "LOGNORMAL_SPECS",
    "AZURE_QUANTILES",
    "LognormalSpec",
    "default_data_dir",
    "load_workload",
    "sample_lengths",
    "arrival_times",
    "solve_lognormal_mu",
    "clamp_request",
    "lognormal_spec",
    "over_limit_share",
    "measured_log_sds",
    "log_sd_range",
]


@dataclass(frozen=True)
class LognormalSpec:
    """Lengths ``max(1, round(exp(mu + sigma * z)))`` whose means are the published ones."""

    prompt_mean: float
    output_mean: float
    prompt_sigma: float
    output_sigma: float
    source: str


LOGNORMAL_SPECS: dict[str, LognormalSpec] = {
    "sharegpt": LognormalSpec(161.31, 337.99, 1.0, 1.0,
                              "means: vLLM paper (Kwon et al., SOSP'23) Fig. 11a; log-sd 1.0 assumed"),
    "alpaca": LognormalSpec(19.31, 58.45, 0.8, 0.8,
                            "means: vLLM paper (Kwon et al., SOSP'23) Fig. 11b; log-sd 0.8 assumed"),
}

# Percentiles (%, then tokens) of the real Azure LLM inference traces 2023 (CC-BY-4.0), measured on
# the copies shipped in pagedkv/data (azure_llm_2023_{conv,code}.csv.gz), from that directory, by:
#   python -c "import numpy as np; P=[0,0.5,1,2,3,5,7.5,10,15,20,25,30,35,40,45,50,55,60,65,70,75,
#   80,85,90,92.5,95,97,98,99,99.5,99.8,99.9,100]; [print(f, c, np.percentile(np.loadtxt(
#   f'azure_llm_2023_{f}.csv.gz', delimiter=',', skiprows=1, usecols=(1, 2), dtype=np.int64)[:, c],
#   P).round().astype(int).tolist()) for f in ('conv', 'code') for c in (0, 1)]"
_PCTS = (0, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, 65, 70, 75,
         80, 85, 90, 92.5, 95, 97, 98, 99, 99.5, 99.8, 99.9, 100)
AZURE_QUANTILES: dict[str, dict[str, tuple[int, ...]]] = {
    "azure-conv": {  # 19,366 requests; ContextTokens (prompt) and GeneratedTokens (output)
        "prompt": (2, 17, 29, 91, 161, 181, 200, 207, 372, 387, 396, 403, 414, 703, 984, 1020, 1045,
                   1071, 1097, 1130, 1189, 1315, 1876, 2734, 4075, 4083, 4090, 4098, 4142, 4831,
                   5652, 6179, 14050),
        "output": (7, 14, 16, 24, 32, 41, 48, 54, 67, 77, 85, 91, 96, 103, 113, 129, 151, 177, 217,
                   384, 395, 400, 411, 424, 430, 451, 509, 540, 601, 643, 917, 954, 1000),
    },
    "azure-code": {  # 8,819 requests
        "prompt": (3, 12, 17, 35, 50, 75, 102, 147, 232, 386, 578, 770, 939, 1075, 1261, 1469, 1690,
                   1909, 2164, 2433, 2744, 3192, 3920, 5188, 6097, 7303, 7435, 7436, 7436, 7436,
                   7436, 7437, 7437),
        "output": (6, 6, 6, 6, 6, 6, 6, 7, 7, 8, 9, 9, 10, 11, 12, 13, 14, 16, 18, 20, 24, 29, 39,
                   55, 69, 90, 128, 171, 251, 359, 670, 825, 1899),
    },
}

BUILTIN_WORKLOADS = ("sharegpt", "alpaca", "azure-conv", "azure-code")
ARRIVALS = ("poisson", "gamma")

_SOLVER_SAMPLES = 200_000  # fixed standard-normal sample the solver averages over (seeded)
_SOLVER_SEED = 20230923  # any fixed seed: the solved mu must not depend on the workload's seed
MIN_ACCEPTANCE = 0.5  # a clamp may trim a tail, not reshape the distribution


# ---- argument checks ----------------------------------------------------------------------------


def _check_max_len(max_len: int | None) -> None:
    if max_len is not None:
        int_at_least("max_len", max_len, 2)


def _check_rng(rng: object) -> None:
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")


# ---- lognormal lengths, solved to the published means --------------------------------------------


def _lengths(mu: float, sigma: float, z: np.ndarray) -> np.ndarray:
    return np.maximum(1, np.rint(np.exp(mu + sigma * z))).astype(np.int64)


@lru_cache(maxsize=64)
def solve_lognormal_mu(prompt_mean: float, output_mean: float, prompt_sigma: float,
                       output_sigma: float, max_len: int | None) -> tuple[float, float]:
    """``(mu_prompt, mu_output)`` such that the produced lengths have the given means.

    Produced lengths are rounded, at least 1, and pairs with ``prompt + output > max_len`` are
    resampled (rejected), so the means are those of the accepted pairs. Solved by the fixed-point
    iteration ``mu += ln(target / mean(mu))`` on a fixed seeded normal sample (deterministic). A
    ``max_len`` so tight that over half the draws would be redrawn is refused (ValueError): ShareGPT
    at 2048 redraws 2% of draws, at 1024 25%, at 700 it is refused.
    Example: ShareGPT, log-sd 1, no clamp -> mu_prompt ~ ln(161.31) - 0.5 = 4.583.
    """
    for name, v in (("prompt_mean", prompt_mean), ("output_mean", output_mean),
                    ("prompt_sigma", prompt_sigma), ("output_sigma", output_sigma)):
        number_at_least(name, v, 0.0, strict=True)
    _check_max_len(max_len)
    if max_len is not None and prompt_mean + output_mean >= max_len:
        raise ValueError(f"means {prompt_mean} + {output_mean} cannot fit under max_len {max_len}")
    z = np.random.default_rng(_SOLVER_SEED).standard_normal((2, _SOLVER_SAMPLES))
    mu_p = math.log(prompt_mean) - prompt_sigma**2 / 2
    mu_o = math.log(output_mean) - output_sigma**2 / 2
    for _ in range(60):
        p, o = _lengths(mu_p, prompt_sigma, z[0]), _lengths(mu_o, output_sigma, z[1])
        keep = np.ones(p.shape, bool) if max_len is None else (p + o <= max_len)
        if keep.mean() < MIN_ACCEPTANCE:
            break
        mp, mo = p[keep].mean(), o[keep].mean()
        if abs(mp / prompt_mean - 1) < 1e-4 and abs(mo / output_mean - 1) < 1e-4:
            return mu_p, mu_o
        mu_p += math.log(prompt_mean / mp)
        mu_o += math.log(output_mean / mo)
    raise ValueError(f"max_len {max_len} is too tight for means {prompt_mean}/{output_mean}: matching "
                     f"them would redraw over {1 - MIN_ACCEPTANCE:.0%} of requests (use a larger max_len)")


# ---- the spread real traces show --------------------------------------------------------------


@lru_cache(maxsize=8)
def _trace_log_sds(path: Path) -> tuple[float, float, int]:
    prompts, outputs = trace_lengths(path)
    prompt = np.array(prompts, dtype=np.float64)
    output = np.array(outputs, dtype=np.float64)
    return float(np.log(prompt).std()), float(np.log(output[output >= 1]).std()), len(prompt)


def measured_log_sds(data_dir: Path | str | None = None) -> dict[str, tuple[float, float, int]]:
    """``{trace: (prompt log-sd, output log-sd, requests)}`` of the public traces found in
    ``data_dir`` (default: :func:`default_data_dir`): the standard deviation of the natural log of
    each length (zero-token outputs left out). This is the spread real serving traffic shows, and
    the range the synthetic workloads' assumed spread is varied over. Measured on the shipped
    files: Azure conv 0.99 / 0.86, Azure code 1.36 / 0.85, Mooncake 1.20 / 1.36.
    """
    out = {}
    for name in TRACE_FILES:
        path = trace_path(name, data_dir)
        if path is not None:
            out[name] = _trace_log_sds(Path(path))
    return out


def log_sd_range(data_dir: Path | str | None = None) -> tuple[float, float] | None:
    """(smallest, largest) log-sd over every length of :func:`measured_log_sds`, or None when no
    trace is found. With the shipped traces about (0.85, 1.36)."""
    sds = [sd for p, o, _ in measured_log_sds(data_dir).values() for sd in (p, o)]
    return (min(sds), max(sds)) if sds else None


# ---- sampling lengths -----------------------------------------------------------------------------


def _draw_lognormal(spec: LognormalSpec, mus: tuple[float, float], n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    z = rng.standard_normal((2, n))
    return _lengths(mus[0], spec.prompt_sigma, z[0]), _lengths(mus[1], spec.output_sigma, z[1])


def _draw_quantiles(table: dict[str, tuple[int, ...]], n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    u = rng.random((2, n)) * 100.0
    p = np.rint(np.interp(u[0], _PCTS, table["prompt"])).astype(np.int64)
    o = np.rint(np.interp(u[1], _PCTS, table["output"])).astype(np.int64)
    return np.maximum(p, 1), np.maximum(o, 1)


def lognormal_spec(name: str, log_sd: float | None = None) -> LognormalSpec:
    """The lognormal workload ``name``'s spec, with both log-sds set to ``log_sd`` when given (the
    means stay the published ones; only the spread changes). ValueError for other workloads."""
    if name not in LOGNORMAL_SPECS:
        raise ValueError(f"log_sd applies to the lognormal workloads ({', '.join(LOGNORMAL_SPECS)}), "
                         f"not {name!r}")
    spec = LOGNORMAL_SPECS[name]
    if log_sd is None:
        return spec
    number_at_least("log_sd", log_sd, 0.0, strict=True)
    return replace(spec, prompt_sigma=float(log_sd), output_sigma=float(log_sd),
                   source=f"{spec.source.split(';')[0]}; log-sd {log_sd:.3g} given")


@lru_cache(maxsize=64)
def over_limit_share(name: str, max_len: int, log_sd: float | None = None) -> float:
    """Share of a lognormal workload's draws that ``prompt + output > max_len`` makes
    :func:`sample_lengths` redraw, on the solver's fixed sample (deterministic). ShareGPT, log-sd 1,
    ``max_len`` 2,048: about 2%."""
    spec = lognormal_spec(name, log_sd)
    int_at_least("max_len", max_len, 2)
    mus = solve_lognormal_mu(spec.prompt_mean, spec.output_mean, spec.prompt_sigma,
                             spec.output_sigma, max_len)
    z = np.random.default_rng(_SOLVER_SEED).standard_normal((2, _SOLVER_SAMPLES))
    p, o = _lengths(mus[0], spec.prompt_sigma, z[0]), _lengths(mus[1], spec.output_sigma, z[1])
    return float((p + o > max_len).mean())


def sample_lengths(name: str, n: int, rng: np.random.Generator,
                   max_len: int | None = None, log_sd: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(prompt_lens, output_lens)`` of ``n`` requests of a built-in workload (int64 arrays).

    With ``max_len``, pairs whose ``prompt + output`` exceeds it are redrawn (the way the vLLM
    benchmarks filter their datasets); ShareGPT/Alpaca parameters are re-solved for that limit so
    their means stay the published ones, while the Azure-like tables are simply truncated there.
    ``log_sd`` replaces the assumed spread of a lognormal workload (ShareGPT, Alpaca).
    """
    if name not in BUILTIN_WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; built-in: {', '.join(BUILTIN_WORKLOADS)}")
    int_at_least("n", n, 0)
    _check_rng(rng)
    _check_max_len(max_len)
    if log_sd is not None or name in LOGNORMAL_SPECS:
        spec = lognormal_spec(name, log_sd)
        mus = solve_lognormal_mu(spec.prompt_mean, spec.output_mean, spec.prompt_sigma,
                                 spec.output_sigma, max_len)
        draw = lambda k: _draw_lognormal(spec, mus, k, rng)  # noqa: E731
    else:
        table = AZURE_QUANTILES[name]
        if max_len is not None and table["prompt"][0] + table["output"][0] > max_len:
            raise ValueError(f"max_len {max_len} is below the shortest {name} request")
        draw = lambda k: _draw_quantiles(table, k, rng)  # noqa: E731
    ps, os_, have = [], [], 0
    while have < n:
        p, o = draw(max(16, int((n - have) * 1.25)))
        if max_len is not None:
            keep = p + o <= max_len
            p, o = p[keep], o[keep]
        ps.append(p)
        os_.append(o)
        have += len(p)
    if not ps:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(ps)[:n], np.concatenate(os_)[:n]


# ---- arrivals -------------------------------------------------------------------------------------


def arrival_times(n: int, rate: float | None, rng: np.random.Generator, process: str = "poisson",
                  cv: float = 2.0) -> np.ndarray:
    """Arrival times in seconds (float64, non-decreasing) of ``n`` requests at ``rate`` per second.

    ``rate=None``: all at 0. ``"poisson"``: exponential gaps of mean 1/rate. ``"gamma"``: Gamma
    gaps with shape ``1/cv**2`` and scale ``cv**2/rate`` (same mean 1/rate, coefficient of variation
    ``cv``: cv = 2 gives shape 0.25, many near-zero gaps and a few long ones, i.e. bursts).
    Example: rate 4, 1000 requests -> the last arrives near 250 s.
    """
    int_at_least("n", n, 0)
    _check_rng(rng)
    if process not in ARRIVALS:
        raise ValueError(f"arrival process must be one of {ARRIVALS}, got {process!r}")
    number_at_least("cv", cv, 0.0, strict=True)
    if rate is None:
        return np.zeros(n)
    number_at_least("rate", rate, 0.0, strict=True, expected="None or a finite number > 0")
    if process == "poisson":
        gaps = rng.exponential(1.0 / rate, n)
    else:
        shape = 1.0 / cv**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    return np.cumsum(gaps)


# ---- assembling requests --------------------------------------------------------------------------


def clamp_request(req: Request, max_len: int) -> Request:
    """Cut a request to ``prompt + output <= max_len``: the prompt keeps at most ``max_len - 1``
    tokens (its tail segments are cut, so shared prefixes stay shared), the output the rest.
    Example: a 3000 + 500 request at 2048 becomes 2047 + 1."""
    int_at_least("max_len", max_len, 2)
    if req.total_len <= max_len:
        return req
    budget, segs = min(req.prompt_len, max_len - 1), []
    for key, length in req.segments:
        if budget <= 0:
            break
        segs.append((key, min(length, budget)))
        budget -= length
    prompt = sum(length for _, length in segs)
    return replace(req, segments=tuple(segs), output_len=min(req.output_len, max_len - prompt))


@dataclass(frozen=True)
class _Shared:
    """Shared system prompts: ``count`` prompts of ``length`` tokens; a ``frac`` of requests get one."""

    count: int = 0
    length: int = 0
    frac: float = 0.0

    def __post_init__(self) -> None:
        int_at_least("system_prompts", self.count, 0)
        int_at_least("system_prompt_len", self.length, 0)
        if number_at_least("system_prompt_frac", self.frac, 0.0, expected="in [0, 1]") > 1:
            raise ValueError(f"system_prompt_frac must be in [0, 1], got {self.frac!r}")
        if self.frac > 0 and (self.count < 1 or self.length < 1):
            raise ValueError("system_prompt_frac > 0 needs system_prompts >= 1 and system_prompt_len >= 1")

    @property
    def active(self) -> bool:
        return self.frac > 0

    def choose(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Per request: the system prompt index, or -1 for none."""
        if not self.active:
            return np.full(n, -1)
        which = rng.integers(0, self.count, n)
        return np.where(rng.random(n) < self.frac, which, -1)


def _synthetic(name: str, num_requests: int, seed: int, max_len: int | None,
               shared: _Shared, rngs, log_sd: float | None = None) -> list[tuple[str, tuple, int]]:
    budget = max_len
    if max_len is not None and shared.active:
        budget = max_len - shared.length
        if budget < 2:
            raise ValueError(f"max_len {max_len} leaves no room after a {shared.length}-token system prompt")
    p, o = sample_lengths(name, num_requests, rngs[0], budget, log_sd)
    ns = f"{name}/seed={seed}"
    return [(f"{name}-{i}", ((content_key("unique", ns, i), int(p[i])),), int(o[i]))
            for i in range(num_requests)]


def load_workload(name_or_path: str | Path, num_requests: int | None = None, seed: int = 0, *,
                  max_len: int | None = None, rate: float | None = None, arrival: str = "poisson",
                  cv: float = 2.0, n: int = 1, beam_width: int = 1, system_prompts: int = 0,
                  system_prompt_len: int = 0, system_prompt_frac: float = 0.0,
                  start: int = 0, log_sd: float | None = None) -> list[Request]:
    """A list of requests from a built-in workload name or a trace file, in arrival order.

    Args:
        name_or_path: ``"sharegpt"``, ``"alpaca"``, ``"azure-conv"``, ``"azure-code"``, or the path
            of an Azure CSV / Mooncake JSONL trace.
        num_requests: how many (required for built-in workloads; for a trace, ``None`` = all).
        seed: seeds every random choice; equal arguments give equal requests.
        max_len: ``prompt + output`` limit, e.g. 2048 as in the vLLM paper. Synthetic lengths are
            redrawn under it, trace requests cut to it (:func:`clamp_request`). System prompts
            count towards it.
        rate, arrival, cv: arrival process (see :func:`arrival_times`); for a trace, ``rate=None``
            keeps its own timestamps; for a built-in workload it puts every arrival at 0.
        n, beam_width: parallel samples or beam width of every request (at most one above 1).
        system_prompts, system_prompt_len, system_prompt_frac: ``system_prompts`` shared prompts of
            ``system_prompt_len`` tokens; each request starts with one (chosen uniformly) with
            probability ``system_prompt_frac``. They are prepended to the drawn prompt.
        start: for a trace, how many records to skip first.
        log_sd: the spread (log-sd of prompt and output lengths) of a lognormal workload
            (ShareGPT, Alpaca) instead of its assumed one; the means stay the published ones.

    Example: ``load_workload("sharegpt", 1000, seed=0, max_len=2048, rate=2.0)``: 1,000 requests,
    mean prompt ~161 and output ~338 tokens, none longer than 2,048, arriving ~2 per second.
    """
    int_at_least("seed", seed, 0)
    int_at_least("n", n, 1)
    int_at_least("beam_width", beam_width, 1)
    if n > 1 and beam_width > 1:
        raise ValueError("use n (parallel sampling) or beam_width (beam search), not both")
    _check_max_len(max_len)
    shared = _Shared(system_prompts, system_prompt_len, system_prompt_frac)
    if max_len is not None and shared.active and shared.length >= max_len:
        raise ValueError(f"system_prompt_len {shared.length} must be below max_len {max_len}")
    rngs = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3)]
    base, times = _base_requests(name_or_path, num_requests, seed, max_len, shared, rngs, start, log_sd)
    if rate is not None or times is None:
        times = arrival_times(len(base), rate, rngs[1], arrival, cv)
    sys_idx = shared.choose(len(base), rngs[2])
    ns = f"system/seed={seed}"
    out = []
    for (rid, segs, out_len), t, j in zip(base, times, sys_idx):
        if j >= 0:
            segs = ((content_key("system", ns, int(j)), shared.length),) + segs
        req = Request(rid, float(t), segs, out_len, n=n, beam_width=beam_width)
        out.append(clamp_request(req, max_len) if max_len is not None else req)
    return out


def _base_requests(name_or_path, num_requests, seed, max_len, shared, rngs, start, log_sd=None):
    """``([(req_id, segments, output_len)], arrival times or None)`` before system prompts."""
    key = name_or_path.lower() if isinstance(name_or_path, str) else None
    if log_sd is not None and key not in LOGNORMAL_SPECS:
        raise ValueError(f"log_sd applies to the lognormal workloads ({', '.join(LOGNORMAL_SPECS)}), "
                         f"not {name_or_path!r}")
    if key in BUILTIN_WORKLOADS:
        if num_requests is None:
            raise ValueError(f"built-in workload {key!r} needs num_requests")
        int_at_least("num_requests", num_requests, 0)
        if start:
            raise ValueError("start applies to trace files only")
        return _synthetic(key, num_requests, seed, max_len, shared, rngs, log_sd), None
    if not isinstance(name_or_path, (str, Path)):
        raise ValueError(f"name_or_path must be a workload name or a path, got {name_or_path!r}")
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"{str(name_or_path)!r} is neither a built-in workload "
                         f"({', '.join(BUILTIN_WORKLOADS)}) nor an existing trace file")
    if num_requests is not None:
        int_at_least("num_requests", num_requests, 0)
    reqs = load_trace(path, limit=num_requests, start=start)
    return [(r.req_id, r.segments, r.output_len) for r in reqs], [r.arrival for r in reqs]
