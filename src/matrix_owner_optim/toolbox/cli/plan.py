"""``matrix-owner-optim plan``: where every parameter lives and how even the ranks are."""

from __future__ import annotations

import argparse
import json
import sys

from torch import nn

from ...optim.report import report_of_plan
from ...planning import MeshAdvice, parse_role, plan_mesh, plan_model
from ..simulate import PRESETS, compare_meshes
from .common import add_model_args, build_model

__all__ = ["add_parser", "run", "format_table"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print the owner plan for a model at any world size (no processes)")
    p.add_argument("--world-size", "-w", type=int, default=8, help="data-parallel ranks to plan for")
    p.add_argument("--preconditioner", default="muon", help="matrix optimizer whose costs to balance")
    p.add_argument(
        "--role",
        action="append",
        default=[],
        metavar="GLOB=ROLE",
        help="override a role, e.g. --role 'layers.*.mlp.fc.weight=tail' (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--shards", action="store_true", help="with --json: include every MatrixShard")
    adv = p.add_argument_group("mesh advice (--advise)")
    adv.add_argument(
        "--advise",
        action="store_true",
        help="advise the (replicate, shard) mesh: the fewest replicas whose owner plan "
        "keeps bytes and FLOPs max/mean <= --max-imbalance (and fits --memory-per-rank)",
    )
    adv.add_argument(
        "--world-sizes",
        default=None,
        metavar="W1,W2,...",
        help="with --advise: one row per world size instead of --world-size",
    )
    adv.add_argument("--max-imbalance", type=float, default=1.1, help="largest max/mean allowed (default 1.1)")
    adv.add_argument(
        "--memory-per-rank",
        type=float,
        default=None,
        metavar="GB",
        help="GB (1e9 bytes) per rank for parameters, gradients and optimizer state",
    )
    adv.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="a100",
        help="hardware the projected times assume (simulate's constants; default a100)",
    )
    adv.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node for the projection")
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


def _world_sizes(args: argparse.Namespace) -> list[int]:
    if args.world_sizes is None:
        return [args.world_size]
    try:
        sizes = [int(x) for x in args.world_sizes.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--world-sizes {args.world_sizes!r}: expected comma-separated integers") from None
    if not sizes:
        raise ValueError("--world-sizes: give at least one world size")
    return sizes


def advise(args: argparse.Namespace, model: nn.Module, prefixes: list[str] | None) -> list[dict]:
    """One JSON-ready row per world size: the advice and its projected times."""
    memory = None if args.memory_per_rank is None else args.memory_per_rank * 1e9
    hw = PRESETS[args.preset].hardware
    rows = []
    for W in _world_sizes(args):
        advice: MeshAdvice = plan_mesh(
            model,
            W,
            unit_prefixes=prefixes,
            roles=_parse_roles(args.role),
            preconditioner=args.preconditioner,
            max_imbalance=args.max_imbalance,
            memory_per_rank=memory,
        )
        row = advice.to_json()
        try:
            cmp = compare_meshes(
                model,
                W,
                unit_prefixes=prefixes,
                gpus_per_node=args.gpus_per_node,
                hardware=hw,
                preconditioner=args.preconditioner,
                roles=_parse_roles(args.role),
                advice=advice,
            )
            row["projection"] = {
                "hardware": hw.name,
                "gpus_per_node": cmp["gpus_per_node"],
                **cmp["layouts"]["owner_hsdp"],
            }
            row["flat_owner_projection"] = cmp["layouts"]["flat_owner"]
        except ValueError as exc:  # a cluster shape the two-level formulas cannot price
            row["projection"] = {"hardware": hw.name, "unavailable": str(exc)}
        rows.append(row)
    return rows


def format_advice(rows: list[dict]) -> str:
    """The advice rows as a table (the README's), the flat owner layout of W ranks beside it."""
    hw = rows[0]["projection"]["hardware"]
    lines = [
        f"{'':>5} {'advised mesh':-^70}  {'flat owner layout, shard W':-^40}",
        f"{'W':>5} {'(rep, shard)':>12} {'bytes m/m':>9} {'FLOPs m/m':>9} {'resident':>9} "
        f"{'opt step':>9} {'comm/step':>10}  {'bytes m/m':>9} {'resident':>9} {'opt step':>9} "
        f"{'comm/step':>10}",
    ]

    def ms(p: dict, key: str) -> str:
        if "unavailable" in p:
            return "n/a"
        return f"{(p[key] if key == 'optimizer_step_ms' else p['fwd_bwd_comm']['total_ms']):.1f}ms"

    for r in rows:
        p, flat = r["projection"], r.get("flat_owner_projection", {"unavailable": ""})
        first = r["candidates"][0]  # shard = W, the flat layout
        lines.append(
            f"{r['world_size']:>5} {'(' + str(r['replicate']) + ', ' + str(r['shard']) + ')':>12} "
            f"{r['bytes_max_over_mean']:>9.4f} {r['flops_max_over_mean']:>9.4f} "
            f"{_human(r['max_resident_bytes']) + 'B':>9} {ms(p, 'optimizer_step_ms'):>9} "
            f"{ms(p, 'comm'):>10}  {first['bytes_max_over_mean']:>9.4f} "
            f"{_human(first['max_resident_bytes']) + 'B':>9} {ms(flat, 'optimizer_step_ms'):>9} "
            f"{ms(flat, 'comm'):>10}"
        )
    r0 = rows[0]
    lines.append(
        f"rule: fewest replicas whose plan keeps bytes and FLOPs max/mean <= {r0['max_imbalance']:g}"
        + (f" and resident bytes <= {_human(r0['memory_per_rank'])}B" if r0["memory_per_rank"] else "")
        + f"; times: {hw} (simulate's constants), optimizer step = busiest owner, comm/step = "
        "forward+backward collectives priced serially"
    )
    lines.append(
        "use it: mesh = advice.init_device_mesh('cuda') (= init_device_mesh('cuda', (rep, shard), "
        "mesh_dim_names=('replicate', 'shard'))), then fully_shard(module, mesh=mesh)"
    )
    for r in rows:
        if "unavailable" in r["projection"]:
            lines.append(f"W={r['world_size']}: no projection: {r['projection']['unavailable']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    model, prefixes = build_model(args, device="meta")
    if args.advise:
        rows = advise(args, model, prefixes)
        if args.json:
            json.dump(rows if args.world_sizes is not None else rows[0], sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            print(format_advice(rows))
        return 0
    if args.world_sizes is not None:
        raise ValueError("--world-sizes needs --advise (a plain plan is for one --world-size)")
    plan = plan_model(
        model,
        args.world_size,
        roles=_parse_roles(args.role),
        preconditioner=args.preconditioner,
        unit_prefixes=prefixes,
    )
    if args.json:
        payload = plan.to_json() if args.shards else plan.summary()
        json.dump(payload, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_table(plan.summary()))
        print(report_of_plan(plan).format())
    return 0
