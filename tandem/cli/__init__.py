"""`tandem` command line: argument parsing at the edge, library calls inside, clear errors (no tracebacks)."""

from __future__ import annotations

import argparse
import re
import sys
import traceback

from ..tools.bench import cli as bench
from ..tools.calibration import cli as calibrate
from ..tools.evaluation import cli as evaluate
from ..tools.simulator import cli as simulate
from . import generate, serve


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
    srv = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server with continuous batching", description=serve.DESCRIPTION
    )
    serve.add_arguments(srv)
    srv.set_defaults(run=serve.run)
    sim = sub.add_parser(
        "simulate",
        help="system model of PNM-KV / PnG-KV platforms and of a GPU host (throughput, energy, cost)",
        description=simulate.DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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


# errors whose message already names the argument and the allowed values
EXPECTED = (CliError, ValueError, FileNotFoundError, MemoryError, NotImplementedError)
_NEGATIVE = re.compile(r"^-[0-9.]")


def _join_negative_values(argv: list[str]) -> list[str]:
    """`--opt -5` -> `--opt=-5`, so that argparse hands a negative number (or `-1k`) to the option, whose own
    check then names the allowed range, instead of taking it for an option ("expected one argument")."""
    out: list[str] = []
    for token in argv:
        if out and _NEGATIVE.match(token) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # anywhere on the line: show the traceback of an error
    argv = _join_negative_values([a for a in argv if a != "--debug"])
    parser = build_parser()
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    args = parser.parse_args(argv)
    args.argv = argv + (["--debug"] if debug else [])  # what `--gpus N` starts again under torchrun
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("tandem: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if debug:
            traceback.print_exc()
        if isinstance(err, EXPECTED):
            print(f"tandem: error: {err}", file=sys.stderr)
            return 2
        # not an error Tandem anticipated: one line, and the way to the whole story
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        print(
            f"tandem: error: {type(err).__name__}: {message} (run with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
