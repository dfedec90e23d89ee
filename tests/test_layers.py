"""The layer listing of docs/design.md section 1 is true of the allocator core: a module imports
only modules listed below it (or itself), so there is no import cycle and nothing imports upwards."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "pagedkv"


def listed_order() -> list[str]:
    text = (ROOT / "docs" / "design.md").read_text()
    block = re.search(r"## 1\. Layers.*?```text\n(.*?)```", text, re.S).group(1)
    names = [line.split()[0] for line in block.splitlines() if line and not line.startswith(" ")]
    return [n for n in names if (PKG / f"{n}.py").exists()]


def relative_imports(module: str) -> set[str]:
    tree = ast.parse((PKG / f"{module}.py").read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_the_core_imports_only_downwards():
    order = listed_order()
    assert {"manager", "coordinator", "hybrid_coordinator", "kv_specs", "pool", "types"} <= set(order)
    rank = {name: i for i, name in enumerate(order)}
    upward = [(m, dep) for m in order for dep in relative_imports(m) if dep in rank and rank[dep] < rank[m]]
    assert upward == []


def test_no_core_module_is_left_out_of_the_listing():
    listed = set(listed_order())
    core = {"manager", "coordinator", "hybrid_coordinator", "state_groups", "invariants", "sequence", "arguments",
            "exports", "copy_queue", "host_tier", "prefix_cache", "pending_events", "pool", "hashing",
            "kv_specs", "checks", "types"}
    assert core <= listed
