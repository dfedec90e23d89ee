"""What a user can ask of ``pagedkv report``; every report section takes one of these."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ReportOptions:
    """Knobs shared by all report sections.

    ``quick`` shrinks every workload (used by the test suite, which checks the report's shape and
    honesty, not its final digits). ``model`` names the model whose KV bytes per token are used to
    turn blocks into bytes (see ``pagedkv size --list``). ``trace`` replays a real trace file in the
    sections that take one; ``data_dir`` is where the bundled public traces are looked for.
    """

    model: str = "Llama-3.1-8B"
    block_size: int = 16
    seed: int = 0
    quick: bool = False
    trace: Path | None = None
    data_dir: Path | None = None
