"""A plain-text progress bar on a terminal stream, for long simulator runs.

Owns the bar's drawing and its redraw throttle, nothing of a run: the serving loop
(:mod:`pagedkv.sim.scheduler`) only reports ``(done, total, status)`` to a callback, and the
``pagedkv simulate --progress`` command (or ``simulate(progress=True)``) draws this bar from
those reports. Imports nothing of pagedkv.

Worked example: ``Progress(10, "paged").update(5, "t=1s")`` draws ``paged [###############
...............]  50% 5/10 t=1s`` on stderr, redrawn at most every 0.2 s. With ``delay=5`` it
draws nothing during its first 5 seconds: a run that ends sooner leaves stderr untouched.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """A plain-text progress bar on stderr, redrawn at most every ``interval`` seconds, and
    first drawn ``delay`` seconds after it was made (0: at the first update)."""

    def __init__(self, total: int, label: str = "", enabled: bool = True, stream: TextIO | None = None,
                 interval: float = 0.2, width: int = 30, delay: float = 0.0) -> None:
        self.total = max(total, 1)
        self.label = label
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.width = width
        self._last = 0.0
        self._start = time.monotonic()
        self.delay = delay
        self.drawn = False
        self._longest = 0

    def update(self, done: int, extra: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._start < self.delay or (not force and now - self._last < self.interval):
            return
        self._last = now
        self.drawn = True
        frac = min(done / self.total, 1.0)
        fill = int(frac * self.width)
        bar = "#" * fill + "." * (self.width - fill)
        line = f"{self.label} [{bar}] {frac:4.0%} {done}/{self.total} {extra}"
        self._longest = max(self._longest, len(line))
        self.stream.write(f"\r{line.ljust(self._longest)}  ")  # spaces cover a longer line drawn before
        self.stream.flush()

    def close(self, done: int, extra: str = "") -> None:
        """Draw the last state and end the line (nothing when the bar was never drawn: a run
        shorter than ``delay``)."""
        if self.enabled:
            self.update(done, extra, force=True)
            if not self.drawn:
                return
            self.stream.write("\n")
            self.stream.flush()

    def report(self, done: int, status: str, final: bool = False) -> None:
        """The callback :func:`~pagedkv.sim.scheduler.simulate` takes: redraw (``final``: draw
        and end the line)."""
        if final:
            self.close(done, status)
        else:
            self.update(done, status)
