"""``matrix-owner-optim simulate --mesh``: the advised (replicate, shard) meshes, priced.

For each world size (default 64, 512 and 4096 GPUs, 8 per node) and each hardware preset
(default A100 and H100), :func:`~matrix_owner_optim.plan_mesh` advises a mesh and
:func:`~matrix_owner_optim.toolbox.simulate.compare_meshes` projects its optimizer step and
per-step communication next to flat stock FSDP2 + Muon, the flat owner layout and stock HSDP
on the same mesh. The model is the simulate command's (the paper's 32 x 4096 GPT by default).
"""

from __future__ import annotations

import argparse
from typing import Any

from ..simulate import MESH_LAYOUTS, PRESETS, SCHEMA, SimOptions, mesh_sweep

__all__ = ["add_mesh_args", "build_mesh_report", "format_mesh_report"]


def add_mesh_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("advised meshes (--mesh)")
    g.add_argument(
        "--mesh",
        action="store_true",
        help="project the plan_mesh-advised (replicate, shard) meshes instead of the node sweep",
    )
    g.add_argument(
        "--world-sizes",
        default="64,512,4096",
        metavar="W1,W2,...",
        help="with --mesh: GPU counts (default 64,512,4096)",
    )
    g.add_argument(
        "--mesh-presets",
        default="a100,h100",
        metavar="P1,P2",
        help="with --mesh: hardware presets to price (default a100,h100)",
    )
    g.add_argument(
        "--max-imbalance", type=float, default=1.1, help="with --mesh: plan_mesh's max/mean limit (default 1.1)"
    )


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} {text!r}: expected positive integers")
    return values


def build_mesh_report(
    args: argparse.Namespace,
    model: Any,
    prefixes: list[str] | None,
    model_desc: dict[str, Any],
    rate_overrides: dict[str, float | None],
) -> dict[str, Any]:
    """Everything ``simulate --mesh`` prints, as one JSON-ready dict."""
    names = [x.strip() for x in args.mesh_presets.split(",") if x.strip()]
    unknown = [n for n in names if n not in PRESETS]
    if unknown or not names:
        raise ValueError(f"--mesh-presets {args.mesh_presets!r}: use some of {', '.join(sorted(PRESETS))}")
    hardwares = [PRESETS[n].hardware.with_overrides(**rate_overrides) for n in names]
    gpus = 8 if args.gpus_per_node is None else args.gpus_per_node
    opts = SimOptions(grad_bytes=args.grad_bytes)
    rows = mesh_sweep(
        model,
        unit_prefixes=prefixes,
        world_sizes=_ints(args.world_sizes, "--world-sizes"),
        hardwares=hardwares,
        gpus_per_node=gpus,
        options=opts,
        max_imbalance=args.max_imbalance,
    )
    return {
        "schema": SCHEMA,
        "kind": "mesh",
        "config": {
            "model": model_desc,
            "gpus_per_node": gpus,
            "max_imbalance": args.max_imbalance,
            "options": opts.to_json(),
        },
        "hardware": {h.name: h.to_json() for h in hardwares},
        "layouts": MESH_LAYOUTS,
        "rows": rows,
    }


def format_mesh_report(report: dict[str, Any]) -> str:
    """The human-readable form of :func:`build_mesh_report`'s dict."""
    lines = ["layouts"] + [f"  {k}: {v}" for k, v in report["layouts"].items()]
    lines += [
        "",
        "per layout: optimizer step ms / forward+backward communication ms per step (serial) / resident GB per rank",
    ]
    order = ("stock_fsdp2_muon", "flat_owner", "owner_hsdp", "stock_fsdp2_hsdp")
    lines.append(f"{'GPUs':>5} {'hw':>5} {'mesh':>10} " + " ".join(f"{k:>26}" for k in order))
    for r in report["rows"]:
        cells = []
        for k in order:
            x = r["layouts"][k]
            cells.append(
                f"{x['optimizer_step_ms']:>8.1f} /{x['fwd_bwd_comm']['total_ms']:>8.1f} /"
                f"{x['max_resident_bytes'] / 1e9:>6.2f}"
            )
        mesh = f"({r['advice']['replicate']},{r['advice']['shard']})"
        lines.append(f"{r['world_size']:>5} {r['hardware']:>5} {mesh:>10} " + " ".join(f"{c:>26}" for c in cells))
    return "\n".join(lines)
