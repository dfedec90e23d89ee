"""The switches a serving scheduler uses against the ways it goes wrong when memory runs out.

Owns :class:`Guards` (one frozen record of five switches, validated at construction) and the
presets the command line names. What each switch does to the loop, and which engine does the
same, is in :class:`Guards`' docstring; the loop that obeys them is
:mod:`pagedkv.sim.scheduler`, which imports this module. It imports nothing of the simulator and
knows no allocator.

Worked example: ``Guards.all_on()`` is every switch on with a 5% watermark;
``Guards().switched("skip_unfreeing", True).describe()`` reads ``newest_first,
no_admit_after_preempt, fit_check, skip_unfreeing``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..checks import flag, number_at_least

__all__ = ["Guards", "GUARD_NAMES", "GUARD_PRESETS", "DEFAULT_WATERMARK"]

GUARD_NAMES = ("newest_first", "no_admit_after_preempt", "fit_check", "skip_unfreeing", "watermark")
DEFAULT_WATERMARK = 0.05  # what Guards.all_on() keeps free: the top of vLLM PR #44594's 0.02-0.05


@dataclass(frozen=True)
class Guards:
    """The switches against the ways a scheduler goes wrong when memory runs out.

    Defaults follow vLLM v1 (every guard on), which is what ``simulate()`` runs without ``guards``:

    ``newest_first`` (on; vLLM v0 and v1 preempt the most recently admitted request): the oldest
        running request is never a victim, so it always progresses. Off: the oldest is preempted
        first, the request with the most work to lose.
    ``no_admit_after_preempt`` (on; vLLM v1 schedules no waiting request in a step that
        preempted): the iteration after a preemption admits nothing, or the victim would be
        readmitted at once and preempted again (thrashing).
    ``fit_check`` (on; vLLM refuses at start-up a ``max_model_len`` its KV cache cannot hold):
        :func:`check_fits` raises ``ValueError`` before the run when the longest request (after
        clipping to ``max_len``) cannot fit in the whole cache; at run time a request that does
        not fit even alone in memory (several samples or beams outgrowing the cache) is dropped
        and reported in ``SimResult.dropped_ids``. Off: it is preempted and retried forever.
    ``skip_unfreeing`` (off; vLLM skips victims whose free is deferred, PR #49675, but not
        victims whose blocks are shared): pass over victims that would free no block (counted
        by :func:`freeable_blocks`) for the next one that frees some; when none does, the first
        in order goes.
    ``watermark`` (0, off; vLLM v1's default; vLLM v0 kept 0.01): admit a request only when
        ``watermark x num_blocks`` blocks stay free after its prompt, unless nothing runs. vLLM
        PR #44594 measured preemptions falling from 1,065 (off) to 400 (0.02) and 187 (0.05) on
        a saturated long-output benchmark (their measurement, not ours). The paged allocator has
        its own ``watermark`` argument (1% by default), applied inside ``admit``; this one is the
        scheduler's, for any allocator that pages (``num_blocks`` > 0; a reservation has none).
    """

    newest_first: bool = True
    no_admit_after_preempt: bool = True
    fit_check: bool = True
    skip_unfreeing: bool = False
    watermark: float = 0.0

    def __post_init__(self) -> None:
        for name in GUARD_NAMES[:-1]:
            flag(f"guard {name}", getattr(self, name))
        if not number_at_least("watermark", self.watermark, 0.0) < 1:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {self.watermark!r}")

    @classmethod
    def all_on(cls, watermark: float = DEFAULT_WATERMARK) -> "Guards":
        """Every guard on, the watermark at ``watermark`` (5% unless given)."""
        return cls(True, True, True, True, watermark)

    @classmethod
    def all_off(cls) -> "Guards":
        return cls(False, False, False, False, 0.0)

    def switched(self, name: str, on: bool, watermark: float = DEFAULT_WATERMARK) -> "Guards":
        """These guards with ``name`` turned on or off (on: ``watermark`` for the watermark)."""
        if name not in GUARD_NAMES:
            raise ValueError(f"unknown guard {name!r}; choose from {', '.join(GUARD_NAMES)}")
        value = (watermark if on else 0.0) if name == "watermark" else on
        return replace(self, **{name: value})

    def is_on(self, name: str) -> bool:
        return bool(getattr(self, name))

    def describe(self) -> str:
        """The guards that are on, e.g. ``newest_first, fit_check, watermark 0.05`` or ``none``."""
        on = [n if n != "watermark" else f"watermark {self.watermark:g}" for n in GUARD_NAMES if self.is_on(n)]
        return ", ".join(on) or "none"


GUARD_PRESETS = {"vllm": Guards(), "all": Guards.all_on(), "none": Guards.all_off()}  # for the CLI
