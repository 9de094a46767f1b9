"""``matrix-owner-optim train``: train the built-in GPT on the embedded corpus, on several ranks.

Without ``torchrun`` it spawns ``--world-size`` CPU ranks (gloo, loopback). Under
``torchrun`` (which sets RANK / WORLD_SIZE / MASTER_ADDR) it joins that job instead, with
NCCL when CUDA is available. Rank 0 shows a progress bar (loss, step time, optimizer-step
time, bytes per phase) and writes ``train.json`` and ``loss.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from ..training import LAYOUTS, OPTIMIZERS, TrainConfig, summarize, train_rank

__all__ = ["add_parser", "run", "format_summary", "plot_losses"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train the built-in GPT on embedded data (several CPU ranks by default)")
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="owner",
        help="owner: owner-shaped ZeRO-3 (this package); fsdp2: stock FSDP2; ddp; single",
    )
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="muon", help="matrix optimizer (tail: AdamW)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--world-size", "-w", type=int, default=4, help="CPU ranks to spawn (ignored under torchrun)")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences), split across ranks")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--matrix-lr", type=float, default=None, help="default: 0.02 for Muon, 0.003 otherwise")
    p.add_argument("--tail-lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/train"), help="where train.json and loss.png go")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    cfg = TrainConfig(
        layout=args.layout,
        optimizer=args.optimizer,
        steps=args.steps,
        global_batch=args.batch,
        seq_len=args.seq_len,
        n_layers=args.layers,
        d_model=args.width,
        n_heads=args.heads,
        matrix_lr=args.matrix_lr,
        tail_lr=args.tail_lr,
        seed=args.seed,
        progress=not args.no_progress,
        warmup=min(10, max(1, args.steps // 10)),
    )
    cfg.validate()
    return cfg


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_summary(summary: dict[str, Any], cfg: TrainConfig) -> str:
    lines = [
        f"layout {cfg.layout}, optimizer {cfg.optimizer}, world size {summary['world_size']}, {cfg.steps} steps",
        f"loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}",
        f"median step {1e3 * summary['median_step_time_s']:.1f} ms, optimizer step "
        f"{1e3 * summary['median_optimizer_time_s']:.2f} ms",
        "bytes sent per step per rank: counted = this package's collectives (CommCounter); "
        "profiled = every gloo/nccl op of one step (torch.profiler, includes stock FSDP2/DDP)",
        f"{'rank':>4} {'fwd counted':>12} {'bwd counted':>12} {'opt counted':>12} "
        f"{'fwd prof':>10} {'bwd prof':>10} {'opt prof':>10} {'resident':>10}",
    ]
    for r in summary["ranks"]:
        b = r["bytes_sent_per_step"]
        pb = r["profiled_bytes"] or {}
        lines.append(
            f"{r['rank']:>4} {_human_bytes(b['forward']):>12} {_human_bytes(b['backward']):>12} "
            f"{_human_bytes(b['optimizer']):>12} {_human_bytes(pb.get('forward', 0)):>10} "
            f"{_human_bytes(pb.get('backward', 0)):>10} {_human_bytes(pb.get('optimizer', 0)):>10} "
            f"{_human_bytes(r['resident_bytes'].get('total', 0)):>10}"
        )
    return "\n".join(lines)


def plot_losses(curves: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, losses in curves.items():
        ax.plot(range(len(losses)), losses, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over ranks)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _strict_shutdown(cfg: TrainConfig) -> bool:
    """Whether every process group can be released at exit (see launch.py). Not with stock
    FSDP2 and torch's own optimizers: their DTensor arithmetic fills torch-internal per-op
    caches that keep the ``DeviceMesh``, and so the group, until the process ends."""
    return cfg.layout != "fsdp2" or cfg.optimizer in ("muon", "shampoo", "soap", "adamw")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if _under_torchrun():
        import torch
        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        cfg.device = "cuda" if backend == "nccl" else "cpu"
        from ... import comm
        from ..launch import shutdown_process_groups

        dist.init_process_group(backend)
        try:
            result = train_rank(dist.get_rank(), dist.get_world_size(), cfg)
            gathered = comm.all_gather_object(result, name="train_results")
        except BaseException:
            dist.destroy_process_group()
            raise
        del result
        # The model and optimizers are garbage now: release them (and DTensor's mesh caches)
        # before destroying the group, so gloo's worker threads are joined before the
        # interpreter exits (see launch.py: otherwise a rank can abort at exit).
        shutdown_process_groups(check=_strict_shutdown(cfg))
        if int(os.environ["RANK"]) != 0:
            return 0
        results = gathered
    else:
        from ..launch import spawn_ranks

        results = spawn_ranks(train_rank, args.world_size, cfg, strict_shutdown=_strict_shutdown(cfg))
    summary = summarize(results)
    print(format_summary(summary, cfg))
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"config": results[0]["config"], "summary": summary, "per_rank_steps": [r["records"] for r in results]}
    (args.out / "train.json").write_text(json.dumps(record, indent=1))
    plot_losses(
        {f"{cfg.layout}+{cfg.optimizer}": summary["losses"]},
        args.out / "loss.png",
        f"GPT {cfg.n_layers}x{cfg.d_model} on the arithmetic corpus, W={summary['world_size']}",
    )
    print(f"wrote {args.out / 'train.json'} and {args.out / 'loss.png'}")
    return 0
