"""`tandem` command line: argument parsing at the edge, library calls inside, clear errors (no tracebacks)."""

from __future__ import annotations

import argparse
import sys

from ..bench import cli as bench
from ..calibration import cli as calibrate
from ..evaluation import cli as evaluate
from ..simulator import cli as simulate
from . import generate


class CliError(Exception):
    """A user-facing error: printed as `tandem: error: ...`, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Long-context LLM decoding with the KV cache split between GPU and host memory.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    gen = sub.add_parser(
        "generate", help="generate text with a Tandem cache", description=generate.DESCRIPTION
    )
    generate.add_arguments(gen)
    gen.set_defaults(run=generate.run)
    sim = sub.add_parser(
        "simulate", help="system model of PNM-KV / PnG-KV platforms (throughput, energy, cost)"
    )
    simulate.add_arguments(sim)
    sim.set_defaults(run=simulate.run)
    ev = sub.add_parser(
        "eval", help="quality of each policy against full attention", description=evaluate.DESCRIPTION
    )
    evaluate.add_arguments(ev)
    ev.set_defaults(run=evaluate.run)
    be = sub.add_parser(
        "bench",
        help="decode speed: Tandem policies vs HF DynamicCache / offloaded cache vs the bandwidth bound",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_arguments(be)
    be.set_defaults(run=bench.run)
    cal = sub.add_parser(
        "calibrate",
        help="measure a model's per-head budgets and write the profile policy 'fluxion' reads",
        description=calibrate.DESCRIPTION,
    )
    calibrate.add_arguments(cal)
    cal.set_defaults(run=calibrate.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("tandem: interrupted", file=sys.stderr)
        return 130
    except (CliError, ValueError, FileNotFoundError, MemoryError, NotImplementedError) as err:
        print(f"tandem: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
