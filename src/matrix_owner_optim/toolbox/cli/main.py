"""Entry point of the ``matrix-owner-optim`` console script."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import bench, plan, simulate, train

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="matrix-owner-optim",
        description="Owner-shaped ZeRO-3 for matrix optimizers: plan, train, bench, simulate.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    plan.add_parser(sub)
    train.add_parser(sub)
    bench.add_parser(sub)
    simulate.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, KeyError) as exc:
        print(f"matrix-owner-optim {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
