"""OwnerDTensor's OpInfo coverage (issue 32): the long form, counted, written to JSON.

    PYTHONPATH=src python benchmarks/opinfo_coverage.py                  # long form, W=2 and W=3
    PYTHONPATH=src python benchmarks/opinfo_coverage.py --mode default   # the CI run's trials

Runs tests/_opinfo_harness.py (every OpInfo operator with float32 CPU samples; the long form:
every sample x every applicable layout x out-of-place / in-place / ``out=``) on gloo ranks and
writes ``benchmarks/results/opinfo_coverage.json``: per world size the counts (exact / refused /
n/a / every kind of violation), the counts per (layout, variant), the refused operators, and
every violation with its detail. Exits non-zero when a violation is found. Hangs abort one
operator (process-group timeout) and the run resumes at the next one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the harness lives beside the tests that run it

from _opinfo_harness import run_world  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("long", "default"), default="long")
    ap.add_argument("--world-sizes", default="2,3")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "opinfo_coverage.json"))
    args = ap.parse_args(argv)
    report: dict[str, object] = {"mode": args.mode, "world_sizes": {}}
    violations = 0
    for W in (int(w) for w in args.world_sizes.split(",")):
        began = time.perf_counter()
        summary = run_world(W, args.mode, on_abort=lambda msg: print(msg, file=sys.stderr))
        other = summary.other()
        violations += len(other)
        report["world_sizes"][str(W)] = {  # type: ignore[index]
            "operators": len(summary.operator_names),
            "operators_compared": len(summary.covered_operators()),
            "trials": len(summary.trials),
            "counts": summary.counts(),
            "per_layout_variant": summary.grid(),
            "refused_operators": summary.refused_operators(),
            "violations": {k: {"verdict": t["verdict"], "detail": t["detail"]} for k, t in sorted(other.items())},
            "seconds": round(time.perf_counter() - began, 1),
        }
        print(f"W={W}: {summary.counts()} ({len(other)} violations)")
        # written after every world size: a long run stopped in the next one keeps this one
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.out}")
    return 1 if violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
