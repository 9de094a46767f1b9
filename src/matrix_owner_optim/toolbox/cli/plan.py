"""``matrix-owner-optim plan``: where every parameter lives and how even the ranks are."""

from __future__ import annotations

import argparse
import json
import sys

from ...optim.report import report_of_plan
from ...planning import parse_role, plan_model
from .common import add_model_args, build_model

__all__ = ["add_parser", "run", "format_table"]


def add_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("plan", help="print the owner plan for a model at any world size (no processes)")
    p.add_argument("--world-size", "-w", type=int, default=8, help="data-parallel ranks to plan for")
    p.add_argument("--preconditioner", default="muon", help="matrix optimizer whose costs to balance")
    p.add_argument("--role", action="append", default=[], metavar="GLOB=ROLE",
                   help="override a role, e.g. --role 'layers.*.mlp.fc.weight=tail' (repeatable)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--shards", action="store_true", help="with --json: include every MatrixShard")
    add_model_args(p, layers=32, width=1024, vocab=50304, heads=16, seq_len=1024)
    p.set_defaults(func=run)


def _parse_roles(items: list[str]) -> dict[str, str]:
    roles: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--role {item!r}: expected GLOB=ROLE")
        glob, role = item.rsplit("=", 1)
        parse_role(role, where=f"--role {glob!r}")
        roles[glob] = role
    return roles


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}" if unit else f"{n:.0f}"
        n /= 1000
    return f"{n:.1f}E"


def format_table(summary: dict, *, max_rows: int = 16) -> str:
    ranks = summary["ranks"]
    lines = [
        f"world size {summary['world_size']}, preconditioner {summary['preconditioner']}, "
        f"{summary['num_tensors']} tensors ({', '.join(f'{k} {v}' for k, v in summary['roles'].items())})",
        f"{'rank':>6} {'resident bytes':>15} {'opt FLOPs':>11} {'matrices':>9} {'tensors':>8}",
    ]
    shown = ranks if len(ranks) <= max_rows else ranks[: max_rows // 2] + ranks[-max_rows // 2 :]
    for i, r in enumerate(shown):
        if len(ranks) > max_rows and i == max_rows // 2:
            lines.append(f"{'...':>6} ({len(ranks) - max_rows} more ranks)")
        lines.append(
            f"{r['rank']:>6} {_human(r['resident_bytes']) + 'B':>15} {_human(r['optimizer_flops']):>11} "
            f"{r['owned_matrices']:>9} {r['owned_tensors']:>8}"
        )
    imb = summary["imbalance"]
    lines.append(
        f"imbalance (max/mean): bytes {imb['bytes_max_over_mean']:.4f}, "
        f"FLOPs {imb['flops_max_over_mean']:.4f}; ranks owning no matrix: "
        f"{summary['ranks_without_matrices']}"
    )
    lines.append(f"digest {summary['digest']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    model, prefixes = build_model(args, device="meta")
    plan = plan_model(model, args.world_size, roles=_parse_roles(args.role),
                      preconditioner=args.preconditioner, unit_prefixes=prefixes)
    if args.json:
        payload = plan.to_json() if args.shards else plan.summary()
        json.dump(payload, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_table(plan.summary()))
        print(report_of_plan(plan).format())
    return 0
