"""The ``pagedkv`` command: ``report | simulate | size | bench | fleet``.

Each subcommand lives in :mod:`pagedkv.commands` as ``add_arguments(parser)`` and ``run(args)``
(and ``describe()`` where its help text carries computed numbers; else its docstring is the help);
this module only wires them to argparse. Every usage error, argparse's own included, is one line
on stderr and exit status 2; a result that cannot be written (a full disk, an I/O error, stdout
on ``/dev/full``) is one line and exit status 1; Ctrl-C is one line and exit status 130 (128 +
SIGINT, the shell's convention). A closed pipe (``pagedkv report | head``) ends quietly with 0.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from . import __version__
from .commands import USAGE_EXIT, WRITE_FAILED_EXIT, one_line
from .report.tables import plain

COMMANDS = {
    "report": "measure fork cost, copy-on-write and memory waste (the main job)",
    "simulate": "run a workload through the serving scheduler on paged or reserved memory",
    "size": "KV bytes per token and how many blocks fit, for a model and a GPU",
    "bench": "time the allocator's hot paths (medians against the design targets)",
    "fleet": "route a real trace across replicas: round-robin, least-loaded, hash ring, precise",
}
INTERRUPTED_EXIT = 130

EPILOG = ("The design, the API contract and the performance targets: docs/design.md in the source "
          "repository. `pagedkv COMMAND --help` for a command's options.")


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (the usage is one ``--help`` away)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(USAGE_EXIT, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pagedkv",
        description="The block allocator behind a paged KV cache, and the tools that measure it.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"pagedkv.commands.{name}")
        text = module.describe() if hasattr(module, "describe") else module.__doc__ or help_text
        p = sub.add_parser(name, help=help_text, description=plain(text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        argv = sys.argv[1:] if argv is None else list(argv)
        if argv[:1] == ["--version"] and len(argv) > 1:
            # argparse would print the version and drop the rest of the line without a word
            parser.error(f"--version takes no arguments, got {' '.join(argv[1:])!r}")
        args = parser.parse_args(argv)
        code = int(args._run(args) or 0)
        if code == WRITE_FAILED_EXIT:  # said so in one line already: do not fail a second time at exit
            _silence_stdout()
        sys.stdout.flush()  # a stdout that cannot take the output fails here, not at exit
        return code
    except KeyboardInterrupt:
        print("pagedkv: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
    except BrokenPipeError:  # `pagedkv report | head` is fine
        _silence_stdout()
        return 0
    except OSError as e:  # a write the commands did not route through their own checks
        what = f"{e.filename}: {e.strerror or e}" if e.filename else f"standard output: cannot write ({e.strerror or e})"
        print(f"pagedkv: error: {one_line(what)}", file=sys.stderr)
        if not e.filename:
            _silence_stdout()
        return WRITE_FAILED_EXIT


def _silence_stdout() -> None:
    """Point stdout at devnull so that the interpreter's final flush does not raise again (what
    the failed write left in the buffer is dropped)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (a test's captured stdout)
        pass


if __name__ == "__main__":
    raise SystemExit(main())
