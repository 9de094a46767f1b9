"""``matrix-owner-optim simulate``: predicted optimizer-step time and memory, three layouts.

Runs the analytic cost model of :mod:`matrix_owner_optim.toolbox.simulate` (no processes, no GPU)
for 1..``--nodes`` nodes of ``--gpus-per-node`` GPUs, prints every constant it uses with its
source, a time table, a memory table and a comparison with the MatrixFSDP paper's and seed
code's numbers (the agreement statements are computed, not written in advance).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from ..models import GPT, GPTConfig
from ..simulate import (
    FORMULAS,
    PAPER_MODEL,
    PRESETS,
    SCHEMA,
    STRATEGIES,
    SimOptions,
    StatsCache,
    compare_with_claims,
    paper_model,
    plot_sweep,
    simulate,
)
from .common import add_model_args, build_model
from .simulate_mesh import add_mesh_args, build_mesh_report, format_mesh_report

__all__ = ["add_parser", "run", "build_report", "format_report"]

# CLI flag -> Hardware field; each flag overrides one stated constant.
_RATE_FLAGS: dict[str, tuple[str, str]] = {
    "peak_tflops": ("--peak-tflops", "bf16 dense peak per GPU, TFLOP/s"),
    "ns_efficiency": ("--ns-efficiency", "achieved fraction of peak for the NS matmuls (0-1]"),
    "intra_bw_gbs": ("--intra-bw", "intra-node bandwidth per GPU per direction, GB/s"),
    "inter_bw_gbs": ("--inter-bw", "inter-node bandwidth per node per direction, GB/s"),
    "intra_latency_us": ("--intra-latency-us", "intra-node latency per ring step, us"),
    "inter_latency_us": ("--inter-latency-us", "inter-node latency per ring step, us"),
    "hbm_bw_gbs": ("--hbm-bw", "HBM bandwidth, GB/s (memory-bound AdamW of non-matrix tensors)"),
    "launch_us": ("--launch-us", "kernel launch overhead per NS kernel, us"),
    "gpu_memory_gb": ("--gpu-memory-gb", "GPU memory capacity, GB (memory table's fits column)"),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``simulate`` on the ``matrix-owner-optim`` subparsers."""
    p = sub.add_parser(
        "simulate",
        help="predict optimizer-step time and memory: reconstruction, all-to-all, owner layout",
        description="Analytic cost model (stated constants, two-level ring collective formulas) of the "
        "optimizer step for stock FSDP2 + Muon reconstruction, all-to-all owner routing and the "
        "owner layout, on N nodes x G GPUs, compared with the MatrixFSDP paper's claims.",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="paper",
        help="hardware and topology: a100, h100, or paper (8 nodes x 8 A100; default)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="largest node count; the table sweeps 1..NODES (default: the preset's, 8)",
    )
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the preset's, 8)")
    rates = p.add_argument_group("rate overrides (each replaces one stated constant)")
    for field_name, (flag, help_text) in _RATE_FLAGS.items():
        rates.add_argument(flag, dest=field_name, type=float, default=None, help=help_text)
    p.add_argument(
        "--grad-bytes",
        type=int,
        choices=(2, 4),
        default=4,
        help="bytes per gradient element the baselines gather/route (4 = fp32, FSDP2's default)",
    )
    p.add_argument(
        "--agree-factor",
        type=float,
        default=1.5,
        help="a prediction agrees with a claim when within this factor (default 1.5)",
    )
    p.add_argument("--no-compare", action="store_true", help="skip the comparison with published claims")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    p.add_argument(
        "--plot", metavar="PATH", default=None, help="write a PNG of predicted step time vs node count (log y)"
    )
    add_model_args(
        p,
        layers=PAPER_MODEL["n_layers"],
        width=PAPER_MODEL["d_model"],
        vocab=PAPER_MODEL["vocab_size"],
        heads=PAPER_MODEL["n_heads"],
        seq_len=PAPER_MODEL["seq_len"],
    )
    add_mesh_args(p)
    p.set_defaults(func=run)


def _model(args: argparse.Namespace) -> tuple[Any, list[str] | None, dict[str, Any]]:
    """The model to simulate, its unit prefixes, and a description for the report."""
    if args.model:
        model, prefixes = build_model(args, device="meta")
        return model, prefixes, {"factory": args.model}
    for name in ("layers", "width", "vocab", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    # Heads do not change any parameter shape; pick a valid count rather than fail on it.
    heads = math.gcd(args.width, max(1, args.heads))
    cfg = GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq_len,
        n_layers=args.layers,
        d_model=args.width,
        n_heads=heads,
        tie_embeddings=not args.untied,
    )
    model = GPT(cfg, device="meta")
    desc = {
        "gpt": {
            "n_layers": cfg.n_layers,
            "d_model": cfg.d_model,
            "vocab_size": cfg.vocab_size,
            "seq_len": cfg.seq_len,
            "n_heads": cfg.n_heads,
            "mlp_ratio": cfg.mlp_ratio,
            "tie_embeddings": cfg.tie_embeddings,
        }
    }
    return model, model.unit_prefixes(), desc


def _is_paper_model(args: argparse.Namespace) -> bool:
    return (
        not args.model
        and not args.untied
        and args.layers == PAPER_MODEL["n_layers"]
        and args.width == PAPER_MODEL["d_model"]
        and args.vocab == PAPER_MODEL["vocab_size"]
        and args.seq_len == PAPER_MODEL["seq_len"]
    )


def build_report(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``simulate`` prints, as one JSON-ready dict."""
    preset = PRESETS[args.preset]
    nodes = preset.nodes if args.nodes is None else args.nodes
    gpus = preset.gpus_per_node if args.gpus_per_node is None else args.gpus_per_node
    for flag, v in (("--nodes", nodes), ("--gpus-per-node", gpus)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    if not args.agree_factor >= 1.0:
        raise ValueError(f"--agree-factor must be >= 1, got {args.agree_factor}")
    if args.ns_efficiency is not None and args.ns_efficiency > 1:
        raise ValueError(f"--ns-efficiency is a fraction of peak, at most 1; got {args.ns_efficiency}")
    hw = preset.hardware.with_overrides(**{k: getattr(args, k) for k in _RATE_FLAGS})
    opts = SimOptions(grad_bytes=args.grad_bytes, agree_factor=args.agree_factor)

    model, prefixes, model_desc = _model(args)
    cache = StatsCache(model, prefixes)
    if not cache.get(1, 1).matrices:
        raise ValueError(
            "the model has no parameter with role 'matrix': a matrix optimizer "
            "has nothing to do, so there is no optimizer step to simulate"
        )
    rows = simulate(
        model,
        unit_prefixes=prefixes,
        node_counts=range(1, nodes + 1),
        gpus_per_node=gpus,
        hardware=hw,
        options=opts,
        cache=cache,
    )
    first = cache.get(1, gpus)
    model_desc.update(
        {
            "parameters": sum(t.numel() for t in {id(q): q for q in model.parameters()}.values()),
            "parameter_bytes": first.total_param_bytes,
            "matrices": len(first.matrices),
            "matrix_elements": sum(m.numel for m in first.matrices),
            "ns_flops_per_step": first.total_matrix_flops,
        }
    )
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "preset": {"name": preset.name, "description": preset.description},
        "config": {
            "nodes": nodes,
            "gpus_per_node": gpus,
            "world_size": nodes * gpus,
            "model": model_desc,
            "options": opts.to_json(),
        },
        "hardware": hw.to_json(),
        "formulas": FORMULAS,
        "strategies": STRATEGIES,
        "sweep": rows,
        "selected": rows[-1],
        "comparison": None,
        "plot": None,
    }
    if not args.no_compare:
        if _is_paper_model(args):
            paper_cache = cache
        else:
            pm, pp = paper_model()
            paper_cache = StatsCache(pm, pp)
        report["comparison"] = compare_with_claims(paper_cache, hw, opts)
    if args.plot:
        title = f"{preset.name}: {hw.gpu.split(' (')[0]}, {gpus} GPUs/node; {_model_line(model_desc)}"
        report["plot"] = plot_sweep(rows, args.plot, title=title)
    return report


def _model_line(desc: dict[str, Any]) -> str:
    g = desc.get("gpt")
    head = (
        f"GPT {g['n_layers']} layers x {g['d_model']}, vocab {g['vocab_size']}" if g else f"model {desc.get('factory')}"
    )
    return f"{head}, {desc['matrices']} matrices"


def _ms(x: float) -> str:
    return f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}" if x >= 1e8 else f"{x / 1e9:.2g}"


def format_report(report: dict[str, Any]) -> str:
    """The human-readable form of :func:`build_report`'s dict."""
    cfg, hw = report["config"], report["hardware"]
    lines = [
        f"preset {report['preset']['name']}: {report['preset']['description']}",
        f"hardware: {hw['gpu']}",
        f"model: {_model_line(cfg['model'])}, {cfg['model']['parameter_bytes'] / 1e9:.2f} GB of "
        f"parameters, {cfg['model']['matrix_elements'] / 1e9:.2f} G matrix elements, Muon NS "
        f"{cfg['model']['ns_flops_per_step'] / 1e12:.1f} TFLOP per step (all matrices)",
        "",
        "constants (value unit -- source: note)",
    ]
    for key, c in hw["constants"].items():
        lines.append(f"  {key:<17} {c['value']:>8g} {c['unit']} -- {c['source']}: {c['note']}")
    o = cfg["options"]
    lines.append(
        f"  gradient bytes/elem gathered or routed: {o['grad_bytes']}; NS dtype bytes: "
        f"{o['ns_bytes']}; NS iterations: {o['ns_steps']}; kernels per matrix: "
        f"{o['kernels_per_matrix']}"
    )
    lines += ["", "formulas"] + [f"  {k}: {v}" for k, v in report["formulas"].items()]
    lines += ["", "strategies"] + [f"  {k}: {v}" for k, v in report["strategies"].items()]

    lines += ["", f"predicted optimizer step (ms), {cfg['gpus_per_node']} GPUs per node"]
    head = (
        f"{'nodes':>5} {'GPUs':>5} {'recon':>8} {'recon-DT':>9} {'a2a':>8} {'owner':>8} "
        f"{'recon/own':>9} {'DT/own':>7} {'a2a/own':>8} {'comm%rec':>8} {'own imb':>7}"
    )
    lines.append(head)
    for r in report["sweep"]:
        s, q = r["strategies"], r["ratios"]
        lines.append(
            f"{r['nodes']:>5} {r['world_size']:>5} {_ms(s['reconstruction']['total_ms']):>8} "
            f"{_ms(s['reconstruction_dtensor']['total_ms']):>9} "
            f"{_ms(s['all_to_all']['total_ms']):>8} "
            f"{_ms(s['owner']['total_ms']):>8} {q['reconstruction_over_owner']:>8.1f}x "
            f"{q['reconstruction_dtensor_over_owner']:>6.1f}x {q['all_to_all_over_owner']:>7.2f}x "
            f"{100 * r['comm_share_of_reconstruction']:>7.0f}% "
            f"{r['planner']['ns_flops_imbalance']:>7.3f}"
        )
    sel = report["selected"]
    lines.append(
        "  owner comm: 0 bytes, 0 collectives; a2a bytes received by the busiest rank at "
        f"{sel['nodes']} nodes: {_gb(sel['strategies']['all_to_all']['comm_bytes_per_rank'])} GB; "
        f"reconstruction: {_gb(sel['strategies']['reconstruction']['comm_bytes_per_rank'])} GB in "
        f"{sel['strategies']['reconstruction']['collectives_per_rank']} all-gathers; "
        "torch Muon on DTensor: "
        f"{_gb(sel['strategies']['reconstruction_dtensor']['comm_bytes_per_rank'])} GB in "
        f"{sel['strategies']['reconstruction_dtensor']['collectives_per_rank']} collectives"
    )

    cap = hw["constants"]["gpu_memory_gb"]["value"] * 1e9
    lines += [
        "",
        f"memory per rank (GB, peak during the step; GPU has {cap / 1e9:g} GB)",
        f"{'nodes':>5} {'GPUs':>5} {'owner':>8} {'recon':>8} {'recon-all':>9} {'a2a':>8} "
        f"{'ZeRO-1':>8} {'ZeRO-1 fits':>11}",
    ]
    for r in report["sweep"]:
        m = r["memory_bytes_per_rank"]
        lines.append(
            f"{r['nodes']:>5} {r['world_size']:>5} {_gb(m['owner']):>8} "
            f"{_gb(m['reconstruction']):>8} {_gb(m['reconstruction_gather_all']):>9} "
            f"{_gb(m['all_to_all']):>8} {_gb(m['zero1_owner']):>8} "
            f"{'yes' if m['zero1_owner'] <= cap else 'no':>11}"
        )
    lines.append(
        "  owner = plan resident bytes (param + grad + state, ZeRO-3-like) + NS workspace; "
        "recon = even ZeRO-3 shards + the largest gathered matrix; recon-all = all "
        "matrices gathered at once; ZeRO-1 = full params and grads on every rank + "
        "owned optimizer state"
    )

    comp = report.get("comparison")
    if comp:
        lines += [
            "",
            f"comparison with published claims (hardware {comp['hardware']}, model "
            f"{comp['model']['n_layers']} layers x {comp['model']['d_model']}, "
            f"agreement = within factor {comp['agree_factor']:g})",
        ]
        for a in comp["assumptions"]:
            lines.append(f"  assumption: {a}")
        for e in comp["claims"]:
            lines.append(f"  [{e['key']}] {e['claim']} ({e['source']})")
            pred = ", ".join(f"{k} {_ms(v)}" for k, v in e["predicted_ms"].items())
            lines.append(f"    predicted ms: {pred}")
            for c in e["comparisons"]:
                lines.append(f"    {c['text']}")
            for w in e["what_if"]:
                lines.append(f"    what would reproduce it: {w['text']}")
        lines.append("  findings:")
        lines += [f"    - {f}" for f in comp["findings"]]
        lines += [f"  note: {n}" for n in comp["notes"]]
    if report.get("plot"):
        lines += ["", f"plot written to {report['plot']}"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Build the report and print it as text or JSON."""
    if args.mesh:
        model, prefixes, desc = _model(args)
        report = build_mesh_report(args, model, prefixes, desc, {k: getattr(args, k) for k in _RATE_FLAGS})
        if args.json:
            json.dump(report, sys.stdout, indent=2, allow_nan=False, default=_json_default)
            sys.stdout.write("\n")
        else:
            print(format_mesh_report(report))
        return 0
    report = build_report(args)
    if args.json:
        json.dump(report, sys.stdout, indent=2, allow_nan=False, default=_json_default)
        sys.stdout.write("\n")
    else:
        print(format_report(report))
    return 0


def _json_default(obj: Any) -> Any:
    raise TypeError(f"simulate: cannot serialise {type(obj).__name__} to JSON")
