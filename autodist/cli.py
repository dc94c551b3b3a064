"""The ``autodist`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autodist", description="AutoDist: plans, cache and environment.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    show = sub.add_parser("show", help="print a plan file as tables")
    show.add_argument("plan", help="path of a plan JSON file")
    args = parser.parse_args(argv)
    if args.version:
        from . import __version__

        print(__version__)
        return 0
    if args.command == "show":
        from .errors import PlanError
        from .plan import load_plan

        try:
            plan = load_plan(args.plan)
        except PlanError as e:
            print(f"autodist show: {e}", file=sys.stderr)
            return 2
        print(plan.to_json())
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
