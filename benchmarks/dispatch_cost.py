"""The owner layout's dispatch cost per operator, against plain tensors and stock DTensor.

Two gloo ranks on CPU. For each operator (the non-communicating rules: holder-local, same layout,
lists) both ranks time the same call on small tensors, so the figure is the dispatch's Python
overhead, not arithmetic: a plain tensor, a stock DTensor (``Shard(0)``, FSDP2's form) and an
owner-layout tensor held by rank 0 (rank 0 computes, rank 1 computes shapes on ``meta``).
Writes ``benchmarks/results/dispatch_cost.json`` and prints a table (microseconds per call,
median of repeats).

    python benchmarks/dispatch_cost.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from matrix_owner_optim.owner_dtensor import OwnerDTensor, mesh_of_group
from matrix_owner_optim.toolbox.launch import spawn_ranks

ROWS, COLS = 64, 64
OPS: dict[str, Callable[[Any, Any], Any]] = {
    "add (out of place)": lambda a, b: a + b,
    "mul_ (in place)": lambda a, b: a.mul_(1.0),
    "addcmul_": lambda a, b: a.addcmul_(b, b, value=0.5),
    "linalg_vector_norm": lambda a, b: torch.linalg.vector_norm(a),
    "zeros_like": lambda a, b: torch.zeros_like(a),
    "_foreach_mul_ (8 tensors)": lambda a, b: torch._foreach_mul_([a] * 8, 1.0),
    "_foreach_norm (8 tensors)": lambda a, b: torch._foreach_norm([a] * 8),
}


def _time(fn: Callable[[], Any], repeats: int, inner: int) -> float:
    for _ in range(inner):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner * 1e6)
    return statistics.median(samples)


def _job(rank: int, world_size: int, repeats: int, inner: int) -> dict:
    torch.manual_seed(0)
    x, y = torch.randn(ROWS, COLS), torch.randn(ROWS, COLS)
    stock_mesh = init_device_mesh("cpu", (world_size,))
    mesh = mesh_of_group(dist.group.WORLD, "cpu")
    layouts = {
        "plain": (x.clone(), y.clone()),
        "stock DTensor Shard(0)": (
            distribute_tensor(x, stock_mesh, [Shard(0)]),
            distribute_tensor(y, stock_mesh, [Shard(0)]),
        ),
        "owner layout (rank 0 holds)": (
            OwnerDTensor.owned(x.clone() if rank == 0 else x[:0].clone(), 0, mesh, x.shape),
            OwnerDTensor.owned(y.clone() if rank == 0 else y[:0].clone(), 0, mesh, y.shape),
        ),
    }
    out: dict = {}
    with torch.no_grad():
        for op, fn in OPS.items():
            out[op] = {
                name: _time(lambda a=a, b=b, fn=fn: fn(a, b), repeats, inner) for name, (a, b) in layouts.items()
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--inner", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "dispatch_cost.json")
    args = parser.parse_args()
    ranks = spawn_ranks(_job, 2, args.repeats, args.inner)
    result = {
        "what": "microseconds per call (median), 2 gloo ranks on CPU, 64x64 float32; rank 0 holds the owner-layout tensors",
        "torch": torch.__version__,
        "ranks": {str(r): v for r, v in enumerate(ranks)},
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    names = list(next(iter(ranks[0].values())).keys())
    print("| operator | " + " | ".join(f"{n} (r0)" for n in names) + " | owner layout (r1, meta) |")
    print("|---|" + "---:|" * (len(names) + 1))
    for op in OPS:
        cells = [f"{ranks[0][op][n]:.1f}" for n in names] + [f"{ranks[1][op][names[-1]]:.1f}"]
        print(f"| {op} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
