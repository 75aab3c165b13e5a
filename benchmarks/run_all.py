"""Run every benchmark and print one markdown table of ratios plus the machine it ran on.

    python benchmarks/run_all.py            # full sizes (what docs/explanation/performance.md quotes)
    python benchmarks/run_all.py --quick    # small sizes, about a minute each
    python benchmarks/run_all.py --only twonn,metrics --json results.json

Each ``benchmarks/bench_<area>.py`` exposes ``run(quick=False) -> list[dict]`` with rows
{benchmark, geomscope, alternative, ratio, target, note}; it alternates geomscope and the
alternative on the same data, repeats, and reports medians.  Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import STANDARD_HEADERS, limit_sources, machine_info, machine_limits, markdown_table  # noqa: E402

AREAS = ["metrics", "twonn", "score", "diagnostics", "extract", "processes", "finetune"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--only", default="", help="comma list of areas: " + ",".join(AREAS))
    ap.add_argument(
        "--json", type=Path, default=None, help="also write all rows and the machine to this file"
    )
    args = ap.parse_args(argv)
    areas = [a.strip() for a in args.only.split(",") if a.strip()] or AREAS
    limits = machine_limits(args.quick)  # first, on an idle machine: every row's bound uses it
    print("[limits] " + ", ".join(f"{k}={v:.1f}" for k, v in limits.items()), file=sys.stderr, flush=True)
    print(f"[limits] by library: {json.dumps(limit_sources())}", file=sys.stderr, flush=True)
    rows, failed = [], []
    for area in areas:
        path = HERE / f"bench_{area}.py"
        if not path.exists():
            print(f"[skip] {path.name} not found", file=sys.stderr)
            continue
        t0 = time.perf_counter()
        print(f"[run] {area} ...", file=sys.stderr, flush=True)
        try:
            mod = importlib.import_module(f"bench_{area}")
            got = mod.run(quick=args.quick)
        except Exception:
            traceback.print_exc()
            failed.append(area)
            continue
        for r in got:
            r.setdefault("area", area)
        rows.extend(got)
        print(f"[done] {area} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print("\n## geomscope benchmarks" + (" (quick)" if args.quick else "") + "\n")
    print(markdown_table(rows, STANDARD_HEADERS))
    info = machine_info()
    print("\nMachine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    print(
        "Limits (measured in this run): "
        + ", ".join(f"{k}={v:.1f}" for k, v in limits.items())
        + "; 'of bound' = the hardware's minimum time for the row's work / the measured time"
    )
    print("GEMM rates by library (the best is the limit): " + json.dumps(limit_sources()))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "rows": rows,
                    "machine": info,
                    "limits": limits,
                    "limit_sources": limit_sources(),
                    "quick": args.quick,
                },
                indent=2,
                default=str,
            )
        )
    if failed:
        print(f"\nFailed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
