"""What the owner layout costs on one rank: the same training step, plain model vs owner layout.

Issue 32's bar: at W=1 the owner layout's training step within 1.02x of the plain model's. The
bench's W=1 rows (``matrix-owner-optim bench --world-sizes 1``) start a process per row and
round, so on a shared CPU their ratio carries the process-to-process noise (+-10%); here both
models live in one process (one gloo rank, ``W=1``), built from the same seed and fed the same
batches, and their steps alternate (plain, owner, owner, plain, ...), so drift falls on both.
Each step is timed by phase (forward, backward, optimizer: ``OwnerRoutedOptimizer(Muon)`` with
float32 Newton-Schulz and AdamW on both, as the bench's rows a and p). Reported: the median of
the per-round ratios (owner / plain) per phase and for the whole step, with the interquartile
range of the ratios; the two models' parameters after the run are compared too (they must be
bitwise equal: W=1 is the plain model).

    python benchmarks/w1_overhead.py                  # GPT 4x256, batch 8 x 32, 40 rounds
    python benchmarks/w1_overhead.py --rounds 10      # a quick look

Writes ``benchmarks/results/w1_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from matrix_owner_optim import OwnerRoutedOptimizer
from matrix_owner_optim.sharding import fully_shard
from matrix_owner_optim.toolbox.data import VOCAB
from matrix_owner_optim.toolbox.launch import free_port
from matrix_owner_optim.toolbox.models.gpt import GPT, GPTConfig

PHASES = ("forward", "backward", "optimizer", "step")


def _optimizer(model: nn.Module) -> OwnerRoutedOptimizer:
    return OwnerRoutedOptimizer(
        model,
        matrix="muon",
        matrix_options={"lr": 0.02, "ns_dtype": torch.float32, "weight_decay": 0.0},
        tail="adamw",
        tail_options={"lr": 3e-3, "weight_decay": 0.0},
    )


def _timed_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    t0 = time.perf_counter()
    loss = model(x, y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    t3 = time.perf_counter()
    return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "step": t3 - t0}


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def measure(rounds: int, *, layers: int, width: int, heads: int, batch: int, seq_len: int) -> dict[str, Any]:
    cfg = GPTConfig(vocab_size=len(VOCAB), seq_len=seq_len, n_layers=layers, d_model=width, n_heads=heads)
    torch.manual_seed(0)
    plain = GPT(cfg)
    torch.manual_seed(0)
    owner = GPT(cfg)
    for block in owner.layers:
        fully_shard(block)
    fully_shard(owner)
    runs = {"plain": (plain, _optimizer(plain)), "owner": (owner, _optimizer(owner))}
    gen = torch.Generator().manual_seed(1)
    warmup = 3
    times: dict[str, list[dict[str, float]]] = {"plain": [], "owner": []}
    for r in range(warmup + rounds):
        x = torch.randint(0, len(VOCAB), (batch, seq_len), generator=gen)
        y = torch.randint(0, len(VOCAB), (batch, seq_len), generator=gen)
        order = ("plain", "owner") if r % 2 == 0 else ("owner", "plain")
        for name in order:
            model, opt = runs[name]
            t = _timed_step(model, opt, x, y)
            if r >= warmup:
                times[name].append(t)
    ratios = {ph: [o[ph] / p[ph] for p, o in zip(times["plain"], times["owner"], strict=True)] for ph in PHASES}
    plain_params = dict(plain.named_parameters())
    equal = all(torch.equal(p.full_tensor(), plain_params[n]) for n, p in owner.named_parameters())
    return {
        "config": {"layers": layers, "width": width, "heads": heads, "batch": batch, "seq_len": seq_len},
        "rounds": rounds,
        "median_ms": {
            name: {ph: 1e3 * statistics.median(t[ph] for t in ts) for ph in PHASES} for name, ts in times.items()
        },
        "ratio_owner_vs_plain": {
            ph: dict(zip(("q1", "median", "q3"), _quartiles(ratios[ph]), strict=True)) for ph in PHASES
        },
        "parameters_bitwise_equal": equal,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
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
    try:
        res = measure(
            args.rounds, layers=args.layers, width=args.width, heads=args.heads, batch=args.batch, seq_len=args.seq_len
        )
    finally:
        dist.destroy_process_group()
    for ph in PHASES:
        q = res["ratio_owner_vs_plain"][ph]
        plain_ms, owner_ms = res["median_ms"]["plain"][ph], res["median_ms"]["owner"][ph]
        print(
            f"{ph:9s} plain {plain_ms:8.1f} ms  owner {owner_ms:8.1f} ms  "
            f"ratio {q['median']:.3f} (IQR {q['q1']:.3f}..{q['q3']:.3f})"
        )
    print(f"parameters bitwise equal: {res['parameters_bitwise_equal']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")
    return 0 if res["parameters_bitwise_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
