"""``turnscale bench [NAME ...] [--json PATH] [--plot DIR]``: run benchmarks, print a table.

Each benchmark is a module ``turnscale.benchmarks.<name>`` (the ``benchmarks/`` folder, installed
under the ``turnscale`` namespace: no top-level ``benchmarks`` module exists outside a checkout)
with ``add_arguments(parser)`` (optional) and ``run(args) -> list[Result]``; it measures the
system beside its baseline in the same run and reports ratios (these machines are shared and
noisy).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from turnscale.benchmarks.common import format_table, write_json

PACKAGE = "turnscale.benchmarks"
"""Where the benchmark modules are imported from (never a bare ``benchmarks``: not installed)."""
BENCHMARKS = ["transport", "envhub", "envgames", "actor", "learner", "weights", "e2e", "fanout"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="turnscale bench", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {BENCHMARKS}); "
                        f"key=value items are config overrides for the benchmarks that take them (actor: engine=vllm_cpu)")
    parser.add_argument("--json", dest="json_path", default="", help="write results as JSON here")
    parser.add_argument("--plot", default="", help="write PNG charts into this folder")
    modules = {}
    for name in BENCHMARKS:
        try:
            modules[name] = importlib.import_module(f"{PACKAGE}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{PACKAGE}.{name}":
                raise
            continue
        if hasattr(modules[name], "add_arguments"):
            modules[name].add_arguments(parser.add_argument_group(name))
    args = parser.parse_args(argv)
    args.overrides = [n for n in args.names if "=" in n]
    names = [n for n in args.names if "=" not in n] or list(modules)
    missing = [n for n in names if n not in modules]
    if missing:
        print(f"turnscale bench: not built yet / unknown: {missing}; available: {list(modules)}", file=sys.stderr)
        return 2
    results = []
    for name in names:
        print(f"== {name}", flush=True)
        got = modules[name].run(args)
        print(format_table(got), flush=True)
        results += got
    print("\n" + format_table(results))
    if args.json_path:
        write_json(args.json_path, results)
    if args.plot:
        from turnscale.benchmarks.plots import plot_results

        plot_results(results, args.plot)
    return 0
