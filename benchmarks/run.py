"""Run pagedkv's benchmarks: ``python benchmarks/run.py [--quick] [--json FILE]``.

The same as ``pagedkv bench``; the benchmark code lives in :mod:`pagedkv.bench` so that an
installed package can time itself too.
"""
import argparse
import sys

from pagedkv.commands import bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=bench.__doc__.splitlines()[0])
    bench.add_arguments(parser)
    sys.exit(bench.run(parser.parse_args()))
