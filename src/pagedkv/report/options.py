"""What a user can ask of ``pagedkv report``; every report section takes one of these."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class ReportOptions:
    """Knobs shared by all report sections.

    ``quick`` shrinks every workload (used by the test suite, which checks the report's shape and
    honesty, not its final digits). ``model`` names the model whose KV bytes per token are used to
    turn blocks into bytes (see ``pagedkv size --list``). ``trace`` replays a real trace file in the
    sections that take one; ``data_dir`` is where the public traces are looked for (default: the
    copies shipped with pagedkv, or ``$PAGEDKV_DATA``). ``nanovllm`` is a checkout of nano-vllm
whose own scheduler the nanovllm section runs (default: ``$PAGEDKV_NANOVLLM``, an installed
``nanovllm`` package, else an engine written here with its rules). ``progress``, when given, receives one
    line at each milestone of a long section (the CLI prints them on stderr); it is not an option
    of the results and is left out of report.json.
    """

    model: str = "Llama-3.1-8B"
    block_size: int = 16
    seed: int = 0
    quick: bool = False
    trace: Path | None = None
    data_dir: Path | None = None
    nanovllm: Path | None = None
    progress: Callable[[str], None] | None = field(default=None, compare=False, repr=False)

    def note(self, message: str) -> None:
        """Report a milestone of a long section to ``progress`` (nothing without one)."""
        if self.progress is not None:
            self.progress(message)
