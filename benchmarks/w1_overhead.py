"""What the owner layout costs on one rank: the same training step, plain model vs owner layout.

Issue 40's bar: at W=1 the owner layout's training step within 1.03x of the plain model's, on
the bench GPT (4 layers x 256) and on a small model (8 layers x 128), whose step is short
enough that the units' per-hook cost shows. The bench's W=1 rows (``matrix-owner-optim bench
--world-sizes 1``) start a process per row and round, so on a shared CPU their ratio carries the
process-to-process noise (+-10%); here every model lives in one process (one gloo rank,
``W=1``): for each size a plain model and an owner-layout one (``fully_shard`` on every block,
then the root), built from the same seed and fed the same batches. Each round steps every
model once, the two of a size back to back in alternating order (plain, owner; owner, plain;
...) and the sizes in alternating order too, so drift and the load of other processes fall on
both sides alike. Each step is timed by phase (forward, backward, optimizer:
``OwnerRoutedOptimizer(Muon)`` with float32 Newton-Schulz and AdamW on both, as the bench's rows
a and p); the whole step also in this thread's CPU time, which a loaded machine's scheduling
does not inflate. Reported per size: the medians, the median of the per-round ratios
(owner / plain) per phase and its interquartile range; the models' parameters after the run are
compared too (they must be bitwise equal: W=1 is the plain model).

    python benchmarks/w1_overhead.py                  # both sizes, batch 8 x 32, 40 rounds
    python benchmarks/w1_overhead.py --rounds 10      # a quick look

Writes ``benchmarks/results/w1_overhead.json`` (with a ``tables`` key for the docs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from matrix_owner_optim import OwnerRoutedOptimizer
from matrix_owner_optim.sharding import fully_shard
from matrix_owner_optim.toolbox.data import VOCAB
from matrix_owner_optim.toolbox.launch import free_port
from matrix_owner_optim.toolbox.models.gpt import GPT, GPTConfig

PHASES = ("forward", "backward", "optimizer", "step")
TARGET = 1.03  # issue 40: the training step within 1.03x of the plain model


@dataclass(frozen=True)
class Size:
    """One model size the benchmark steps."""

    name: str
    layers: int
    width: int
    heads: int


SIZES = {
    "gpt4x256": Size("bench GPT 4 x 256", 4, 256, 4),
    "gpt8x128": Size("GPT 8 x 128", 8, 128, 4),
}


def _optimizer(model: nn.Module) -> OwnerRoutedOptimizer:
    return OwnerRoutedOptimizer(
        model,
        matrix="muon",
        matrix_options={"lr": 0.02, "ns_dtype": torch.float32, "weight_decay": 0.0},
        tail="adamw",
        tail_options={"lr": 3e-3, "weight_decay": 0.0},
    )


def _timed_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    c0 = time.thread_time()
    t0 = time.perf_counter()
    loss = model(x, y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    t3 = time.perf_counter()
    c1 = time.thread_time()
    return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "step": t3 - t0, "step_cpu": c1 - c0}


def _quartiles(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4)
    return {"q1": q[0], "median": statistics.median(xs), "q3": q[2]}


class Pair:
    """A plain model and its owner-layout twin of one size, with their optimizers and timings."""

    def __init__(self, size: Size, seq_len: int) -> None:
        self.size = size
        cfg = GPTConfig(
            vocab_size=len(VOCAB), seq_len=seq_len, n_layers=size.layers, d_model=size.width, n_heads=size.heads
        )
        torch.manual_seed(0)
        self.plain = GPT(cfg)
        torch.manual_seed(0)
        self.owner = GPT(cfg)
        for block in self.owner.layers:
            fully_shard(block)
        fully_shard(self.owner)
        self.runs = {"plain": (self.plain, _optimizer(self.plain)), "owner": (self.owner, _optimizer(self.owner))}
        self.times: dict[str, list[dict[str, float]]] = {"plain": [], "owner": []}

    def round(self, r: int, x: torch.Tensor, y: torch.Tensor, keep: bool) -> None:
        for name in ("plain", "owner") if r % 2 == 0 else ("owner", "plain"):
            model, opt = self.runs[name]
            t = _timed_step(model, opt, x, y)
            if keep:
                self.times[name].append(t)

    def result(self) -> dict[str, Any]:
        plain, owner = self.times["plain"], self.times["owner"]
        keys = (*PHASES, "step_cpu")
        ratios = {k: [o[k] / p[k] for p, o in zip(plain, owner, strict=True)] for k in keys}
        plain_params = dict(self.plain.named_parameters())
        equal = all(
            torch.equal(cast(DTensor, p).full_tensor(), plain_params[n]) for n, p in self.owner.named_parameters()
        )
        s = self.size
        return {
            "model": {"name": s.name, "layers": s.layers, "width": s.width, "heads": s.heads},
            "parameters": sum(p.numel() for p in self.plain.parameters()),
            "median_ms": {
                name: {k: 1e3 * statistics.median(t[k] for t in ts) for k in keys} for name, ts in self.times.items()
            },
            "ratio_owner_vs_plain": {k: _quartiles(ratios[k]) for k in keys},
            "parameters_bitwise_equal": equal,
        }


def measure(rounds: int, sizes: list[Size], *, batch: int, seq_len: int) -> dict[str, Any]:
    pairs = [Pair(s, seq_len) for s in sizes]
    gen = torch.Generator().manual_seed(1)
    warmup = 3
    for r in range(warmup + rounds):
        x = torch.randint(0, len(VOCAB), (batch, seq_len), generator=gen)
        y = torch.randint(0, len(VOCAB), (batch, seq_len), generator=gen)
        for pair in pairs if r % 2 == 0 else pairs[::-1]:
            pair.round(r, x, y, keep=r >= warmup)
    return {key: pair.result() for key, pair in zip((k for k, v in SIZES.items() if v in sizes), pairs, strict=True)}


def tables(results: dict[str, Any], rounds: int, batch: int, seq_len: int) -> list[dict[str, Any]]:
    """The docs' tables: one row per phase and size, and the verdict per size."""
    rows = []
    for res in results.values():
        for k in (*PHASES, "step_cpu"):
            q = res["ratio_owner_vs_plain"][k]
            rows.append(
                [
                    res["model"]["name"],
                    "step (thread CPU time)" if k == "step_cpu" else k,
                    round(res["median_ms"]["plain"][k], 2),
                    round(res["median_ms"]["owner"][k], 2),
                    round(q["median"], 3),
                    f"{q['q1']:.3f}..{q['q3']:.3f}",
                ]
            )
    verdict = [
        [
            res["model"]["name"],
            res["parameters"],
            round(res["ratio_owner_vs_plain"]["step"]["median"], 3),
            round(res["ratio_owner_vs_plain"]["step_cpu"]["median"], 3),
            TARGET,
            "yes" if res["parameters_bitwise_equal"] else "NO",
        ]
        for res in results.values()
    ]
    note = (
        f"W=1, one gloo process, {rounds} rounds after 3 warm-up rounds, batch {batch} x {seq_len}, "
        "OwnerRoutedOptimizer(Muon, float32 Newton-Schulz) + AdamW on both sides, torch threads 1; "
        "each round steps plain and owner back to back in alternating order. Ratios are the medians "
        "of the per-round ratios owner / plain, IQR their quartiles. Milliseconds on a shared CPU are "
        "noise in absolute terms: read the ratios."
    )
    return [
        {
            "title": "One rank: the owner layout's training step against the plain model",
            "columns": ["model", "phase", "plain ms", "owner ms", "ratio owner / plain", "IQR of the ratio"],
            "rows": rows,
            "note": note,
        },
        {
            "title": "One rank: training step ratio against issue 40's bar",
            "columns": ["model", "parameters", "step ratio (wall)", "step ratio (CPU)", "bar", "bitwise equal"],
            "rows": verdict,
            "note": note,
        },
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=list(SIZES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "w1_overhead.json")
    args = ap.parse_args(argv)
    if args.rounds < 4:
        ap.error("--rounds must be >= 4 (quartiles of the per-round ratios)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    sizes = [SIZES[k] for k in SIZES if k in args.sizes]
    try:
        results = measure(args.rounds, sizes, batch=args.batch, seq_len=args.seq_len)
    finally:
        dist.destroy_process_group()
    for res in results.values():
        print(f"{res['model']['name']} ({res['parameters']} parameters)")
        for k in (*PHASES, "step_cpu"):
            q = res["ratio_owner_vs_plain"][k]
            plain_ms, owner_ms = res["median_ms"]["plain"][k], res["median_ms"]["owner"][k]
            print(
                f"  {k:9s} plain {plain_ms:8.2f} ms  owner {owner_ms:8.2f} ms  "
                f"ratio {q['median']:.3f} (IQR {q['q1']:.3f}..{q['q3']:.3f})"
            )
        print(f"  parameters bitwise equal: {res['parameters_bitwise_equal']}")
    out = {
        "what": "W=1 training step, owner layout vs the plain model, in one process (benchmarks/w1_overhead.py)",
        "torch": torch.__version__,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "load_average": list(os.getloadavg())},
        "config": {"rounds": args.rounds, "warmup": 3, "batch": args.batch, "seq_len": args.seq_len},
        "target_step_ratio": TARGET,
        "models": results,
        "tables": tables(results, args.rounds, args.batch, args.seq_len),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(res["parameters_bitwise_equal"] for res in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
