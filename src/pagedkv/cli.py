"""The ``pagedkv`` command: ``report | simulate | size | bench``.

Each subcommand lives in :mod:`pagedkv.commands` as ``add_arguments(parser)`` and ``run(args)``;
this module only wires them to argparse.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "report": "measure fork cost, copy-on-write and memory waste (the main job)",
    "simulate": "run a workload through the serving scheduler on paged or reserved memory",
    "size": "KV bytes per token and how many blocks fit, for a model and a GPU",
    "bench": "time the allocator's hot paths (medians against the design targets)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedkv",
        description="The block allocator behind a paged KV cache, and the tools that measure it.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"pagedkv.commands.{name}")
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:  # `pagedkv report | head` is fine
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
