"""``matrix-owner-optim bench``: the owner layout against its baselines, side by side, in one run.

Rows (all on the built-in GPT, embedded data, CPU gloo ranks):

* ``a``  owner layout + OwnerRoutedOptimizer(Muon): zero optimizer bytes
* ``b``  stock FSDP2 + ``torch.optim.Muon`` on the DTensors (the reference ratio's denominator)
* ``c``  stock FSDP2 + reconstruction (full update all-gathered on every rank, NS, slice)
* ``d``  stock FSDP2 + OwnerRoutedOptimizer(Muon) (gradient shards all-to-all to owners)
* ``e``  stock FSDP2 + AdamW
* ``a-shampoo`` / ``c-shampoo``, ``a-soap`` / ``c-soap``: owner layout vs reconstruction
* ``h`` / ``h-fwd`` / ``h-replicas``: the owner layout on a (2, W/2) HSDP mesh, one global owner
  per matrix with the replicas' broadcast at the end of ``step()`` / deferred into the next
  forward's gathers, and every replica stepping what it holds (HSDP before global owners)
* ``p``  the plain model, no sharding, + OwnerRoutedOptimizer(Muon): only at W=1, where it is
  the base that row ``a`` (the owner layout on one rank) must match

``--muon-batching`` instead times Muon's step with same-shape matrices batched through one
stacked Newton-Schulz against one matrix at a time (one process, the built-in GPT's matrices
and a few larger stacks), prints both and writes ``muon_batching.json``.

Rows run alternately for ``--rounds`` rounds (forward order, then reverse) so machine drift
cancels; medians are taken over steps after warm-up, then over rounds. Bytes per phase come
from ``torch.profiler`` (every gloo op, stock FSDP2's included) and from CommCounter (this
package's collectives); resident bytes are parameters + gradients + optimizer state at the
end of the run, max over ranks. Writes ``bench.json``, ``bench.md`` and two PNGs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..launch import spawn_ranks
from ..training import TrainConfig, summarize, train_rank

__all__ = ["ROWS", "add_parser", "run", "run_bench", "markdown_table", "muon_batching_timings"]

ROWS: dict[str, tuple[str, str, str]] = {
    "a": ("owner", "muon", "owner layout + OwnerRoutedOptimizer(Muon)"),
    "b": ("fsdp2", "torch_muon", "stock FSDP2 + torch.optim.Muon"),
    "c": ("fsdp2", "reconstruction", "stock FSDP2 + reconstruction (gather, NS, slice)"),
    "d": ("fsdp2", "muon", "stock FSDP2 + OwnerRoutedOptimizer(Muon), all-to-all"),
    "e": ("fsdp2", "torch_adamw", "stock FSDP2 + AdamW"),
    "a-shampoo": ("owner", "shampoo", "owner layout + Shampoo"),
    "c-shampoo": ("fsdp2", "reconstruction_shampoo", "stock FSDP2 + reconstruction Shampoo"),
    "a-soap": ("owner", "soap", "owner layout + SOAP"),
    "c-soap": ("fsdp2", "reconstruction_soap", "stock FSDP2 + reconstruction SOAP"),
    "p": ("single", "muon", "plain model (no sharding) + OwnerRoutedOptimizer(Muon)"),
    "h": (
        "owner_hsdp",
        "muon",
        "owner layout on a (2, W/2) mesh, one global owner per matrix + Muon, broadcast at step()",
    ),
    "h-fwd": (
        "owner_hsdp",
        "muon",
        "owner layout on a (2, W/2) mesh, one global owner per matrix + Muon, broadcast deferred to the next forward",
    ),
    "h-replicas": ("owner_hsdp_replicas", "muon", "owner layout on a (2, W/2) mesh, every replica steps + Muon"),
}
ROW_OPTIONS: dict[str, dict[str, Any]] = {  # TrainConfig fields a row sets beyond layout and optimizer
    "h": {"replica_broadcast": "step"},
    "h-fwd": {"replica_broadcast": "forward"},
}
ONE_RANK_ROWS = ("a", "p")  # at W=1: what the owner layout costs over the plain model


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="owner layout vs stock FSDP2 + Muon vs reconstruction, side by side")
    p.add_argument("--world-sizes", default="1,2,4", help="comma-separated, e.g. 1,2,4 (W=1 runs rows a and p only)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    p.add_argument("--steps", type=int, default=6, help="steps per run (the first 2 are warm-up)")
    p.add_argument("--rounds", type=int, default=2, help="alternating repetitions of every row")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument(
        "--muon-batching", action="store_true", help="time Muon batched vs per-matrix Newton-Schulz instead of the rows"
    )
    p.set_defaults(func=run)


def muon_batching_timings(
    cases: dict[str, list[tuple[int, int]]] | None = None, *, steps: int = 5, rounds: int = 2
) -> list[dict[str, Any]]:
    """Median step time of Muon with ``batched=True`` and ``batched=False`` per case and dtype.

    Each case is a list of matrix shapes (one parameter group). The two variants alternate for
    ``rounds`` rounds so machine drift cancels; the first step of each run is warm-up.
    """
    import torch

    from ...preconditioners import Muon

    if cases is None:
        cases = {
            "gpt(d=256,L=4) matrices": [(768, 256), (256, 256), (1024, 256), (256, 1024)] * 4,
            "16 x 256x256": [(256, 256)] * 16,
            "8 x 512x1024 + 8 x 1024x512": [(512, 1024)] * 8 + [(1024, 512)] * 8,
            "64 x 64x64": [(64, 64)] * 64,
        }

    def one(shapes: list[tuple[int, int]], dtype: torch.dtype, batched: bool) -> float:
        gen = torch.Generator().manual_seed(0)
        params = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt = Muon(params, ns_dtype=dtype, batched=batched)
        opt.step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    out = []
    for name, shapes in cases.items():
        for dtype in (torch.bfloat16, torch.float32):
            per: dict[bool, list[float]] = {True: [], False: []}
            for r in range(rounds):
                for batched in (False, True) if r % 2 == 0 else (True, False):
                    per[batched].append(one(shapes, dtype, batched))
            per_matrix, batched_s = statistics.median(per[False]), statistics.median(per[True])
            out.append(
                {
                    "case": name,
                    "ns_dtype": str(dtype).replace("torch.", ""),
                    "matrices": len(shapes),
                    "per_matrix_s": per_matrix,
                    "batched_s": batched_s,
                    "ratio": batched_s / per_matrix,
                }
            )
    return out


def _parse_list(text: str, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"--{what} is empty")
    return items


def run_bench(
    world_sizes: list[int],
    rows: list[str],
    *,
    steps: int,
    rounds: int,
    layers: int,
    width: int,
    heads: int,
    batch: int,
    seq_len: int,
) -> dict[str, Any]:
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ValueError(f"unknown bench row {unknown[0]!r}; rows are {', '.join(ROWS)}")
    if steps < 3:
        raise ValueError("--steps must be >= 3 (2 warm-up steps are excluded from medians)")
    results: dict[str, Any] = {
        "config": {
            "world_sizes": world_sizes,
            "rows": rows,
            "steps": steps,
            "rounds": rounds,
            "layers": layers,
            "width": width,
            "heads": heads,
            "batch": batch,
            "seq_len": seq_len,
        },
        "runs": {},
    }
    for W in world_sizes:
        w_rows = [r for r in rows if r in ONE_RANK_ROWS] if W == 1 else [r for r in rows if r != "p"]
        if not w_rows:
            continue
        per_row: dict[str, list[dict[str, Any]]] = {r: [] for r in w_rows}
        for rnd in range(rounds):
            order = w_rows if rnd % 2 == 0 else list(reversed(w_rows))
            for row in order:
                layout, optimizer, _ = ROWS[row]
                cfg = TrainConfig(
                    layout=layout,
                    optimizer=optimizer,
                    steps=steps,
                    global_batch=batch,
                    seq_len=seq_len,
                    n_layers=layers,
                    d_model=width,
                    n_heads=heads,
                    warmup=1,
                    profile_step=steps - 1,
                    ns_dtype="bfloat16",
                    **ROW_OPTIONS.get(row, {}),
                )
                per_row[row].append(summarize(spawn_ranks(train_rank, W, cfg)))
        results["runs"][str(W)] = {row: _aggregate(row, runs) for row, runs in per_row.items()}
        runs_w = results["runs"][str(W)]
        base = runs_w.get("p" if W == 1 else "b")  # the plain model on one rank
        for agg in runs_w.values():
            agg["base_row"] = base["row"] if base else None
            agg["optimizer_time_ratio_vs_base"] = (
                agg["median_optimizer_time_s"] / base["median_optimizer_time_s"] if base else None
            )
            agg["step_time_ratio_vs_base"] = agg["median_step_time_s"] / base["median_step_time_s"] if base else None
    return results


def _aggregate(row: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    layout, optimizer, label = ROWS[row]
    last = runs[-1]

    ranks = last["ranks"]  # each figure is the busiest rank's

    def per_rank_max(value_of: Callable[[dict[str, Any]], Any]) -> int:
        return max(int(value_of(r)) for r in ranks)

    phases = ("forward", "backward", "optimizer")
    prof = {ph: max(int((r["profiled_bytes"] or {}).get(ph, 0)) for r in ranks) for ph in phases}
    counted = {ph: max(int(r["bytes_sent_per_step"][ph]) for r in ranks) for ph in phases}
    return {
        "row": row,
        "layout": layout,
        "optimizer": optimizer,
        "label": label,
        "median_optimizer_time_s": statistics.median(r["median_optimizer_time_s"] for r in runs),
        "median_step_time_s": statistics.median(r["median_step_time_s"] for r in runs),
        # per round (rows alternate within a round): ratios between rows round by round
        "optimizer_time_s_per_round": [r["median_optimizer_time_s"] for r in runs],
        "step_time_s_per_round": [r["median_step_time_s"] for r in runs],
        "bytes_sent_per_rank_profiled": prof,
        "bytes_sent_per_rank_counted": counted,
        "resident_bytes_per_rank_max": per_rank_max(lambda r: r["resident_bytes"]["total"]),
        "optimizer_state_bytes_per_rank_max": per_rank_max(lambda r: r["resident_bytes"]["optimizer_state"]),
        "final_loss": last["final_loss"],
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def markdown_table(results: dict[str, Any]) -> str:
    lines = []
    for W, rows in results["runs"].items():
        base = "p" if W == "1" else "b"
        lines += [
            f"**W={W}** (GPT {results['config']['layers']}x{results['config']['width']}, "
            f"{results['config']['steps']} steps x {results['config']['rounds']} rounds)",
            "",
            f"| row | setup | opt step ms | opt ratio vs ({base}) | step ms | step ratio vs ({base}) "
            "| fwd MiB | bwd MiB | opt MiB | opt MiB (ours) | resident MiB |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row, a in rows.items():
            p, c = a["bytes_sent_per_rank_profiled"], a["bytes_sent_per_rank_counted"]
            ratio, step_ratio = a["optimizer_time_ratio_vs_base"], a["step_time_ratio_vs_base"]
            lines.append(
                f"| {row} | {a['label']} | {1e3 * a['median_optimizer_time_s']:.1f} | "
                f"{'' if ratio is None else f'{ratio:.3f}'} | {1e3 * a['median_step_time_s']:.1f} | "
                f"{'' if step_ratio is None else f'{step_ratio:.3f}'} | "
                f"{_mib(p['forward'])} | {_mib(p['backward'])} | {_mib(p['optimizer'])} | "
                f"{_mib(c['optimizer'])} | {_mib(a['resident_bytes_per_rank_max'])} |"
            )
        lines.append("")
    lines.append(
        "Bytes are sent per rank per step (max over ranks); 'fwd/bwd/opt MiB' from torch.profiler "
        "(every gloo op), 'opt MiB (ours)' from CommCounter. Times are medians on a shared "
        "2-core CPU: read the ratios, not the milliseconds."
    )
    return "\n".join(lines)


def _plots(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, ylabel, fname, scale in (
        ("median_optimizer_time_s", "optimizer step (ms, median)", "bench_optimizer_time.png", 1e3),
        ("bytes_opt", "optimizer-step bytes sent per rank (MiB)", "bench_optimizer_bytes.png", 1 / 2**20),
    ):
        fig, ax = plt.subplots(figsize=(8, 4))
        sizes = list(results["runs"])
        rows: list[str] = []  # every row any world size ran (W=1 runs only a and p)
        for per_w in results["runs"].values():
            rows += [r for r in per_w if r not in rows]
        width = 0.8 / max(1, len(sizes))
        for i, W in enumerate(sizes):
            vals = []
            for row in rows:
                a = results["runs"][W].get(row)
                if a is None:
                    vals.append(float("nan"))  # not run at this world size: no bar
                    continue
                v = a["bytes_sent_per_rank_profiled"]["optimizer"] if key == "bytes_opt" else a[key]
                vals.append(v * scale)
            ax.bar([j + i * width for j in range(len(rows))], vals, width=width, label=f"W={W}")
        ax.set_xticks([j + width * (len(sizes) - 1) / 2 for j in range(len(rows))])
        ax.set_xticklabels(rows, rotation=30, ha="right")
        ax.set_ylabel(ylabel)
        if key != "bytes_opt":
            ax.set_yscale("log")
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        path = out / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def run(args: argparse.Namespace) -> int:
    if getattr(args, "muon_batching", False):
        timings = muon_batching_timings(steps=max(args.steps, 3), rounds=args.rounds)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "muon_batching.json").write_text(json.dumps(timings, indent=1))
        print("| case | ns dtype | matrices | per-matrix ms | batched ms | batched/per-matrix |")
        print("|---|---|---|---|---|---|")
        for t in timings:
            print(
                f"| {t['case']} | {t['ns_dtype']} | {t['matrices']} | "
                f"{t['per_matrix_s'] * 1e3:.1f} | {t['batched_s'] * 1e3:.1f} | "
                f"{t['ratio']:.2f} |"
            )
        print(f"wrote {args.out / 'muon_batching.json'}")
        return 0
    world_sizes = [int(w) for w in _parse_list(args.world_sizes, "world-sizes")]
    rows = _parse_list(args.rows, "rows")
    t0 = time.time()
    results = run_bench(
        world_sizes,
        rows,
        steps=args.steps,
        rounds=args.rounds,
        layers=args.layers,
        width=args.width,
        heads=args.heads,
        batch=args.batch,
        seq_len=args.seq_len,
    )
    results["wall_time_s"] = time.time() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(results, indent=1))
    table = markdown_table(results)
    (args.out / "bench.md").write_text(table + "\n")
    plots = _plots(results, args.out)
    print(table)
    print(f"wrote {args.out / 'bench.json'}, {args.out / 'bench.md'}, {', '.join(str(p) for p in plots)}")
    return 0
