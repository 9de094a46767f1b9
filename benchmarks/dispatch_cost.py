"""The owner layout's dispatch cost per operator, against plain tensors and stock DTensor.

Two gloo ranks on CPU. For each operator (the non-communicating rules: holder-local, same layout,
lists, ``copy_``) both ranks time the same call on small tensors, so the figure is the
dispatch's host overhead, not arithmetic: a plain tensor, a stock DTensor (``Shard(0)``, FSDP2's
form) and an owner-layout tensor held by rank 0 (rank 0 is the holder and computes; rank 1 holds
empty pieces and computes nothing). The list rows take 53 tensors (PyTorch's test Transformer
has 53 parameters). Rounds alternate the layouts (one sample of each per round), so load from
other processes hits every column alike; the figures are medians over rounds, in wall time and
in the rank's thread CPU time (``time.thread_time``: what the call costs the host, unchanged by
other processes taking the cores; a loaded machine's wall figures are mostly waiting).

Writes ``benchmarks/results/dispatch_cost.json`` (with a ``tables`` key) and prints the table
(microseconds per call; ratio = owner layout / stock DTensor on the same rank, same run).

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
LIST = 53  # tensors in the list rows (PyTorch's test Transformer: 53 parameters)


def _ops() -> dict[str, Callable[[list, list], Any]]:
    return {
        "add (out of place)": lambda a, b: a[0] + b[0],
        "mul_ (in place)": lambda a, b: a[0].mul_(1.0),
        "addcmul_": lambda a, b: a[0].addcmul_(b[0], b[0], value=0.5),
        "lerp_ (EMA: e.lerp_(p, 0.001))": lambda a, b: a[0].lerp_(b[0], 0.001),
        "copy_ (same layout)": lambda a, b: a[0].copy_(b[0]),
        "linalg_vector_norm": lambda a, b: torch.linalg.vector_norm(a[0]),
        "zeros_like": lambda a, b: torch.zeros_like(a[0]),
        "detach": lambda a, b: a[0].detach(),
        f"_foreach_mul_ ({LIST} tensors)": lambda a, b: torch._foreach_mul_(a, 1.0),
        f"_foreach_lerp_ ({LIST} tensors)": lambda a, b: torch._foreach_lerp_(a, b, 0.001),
        f"_foreach_norm ({LIST} tensors)": lambda a, b: torch._foreach_norm(a),
    }


def _sample(fn: Callable[[], Any], inner: int) -> tuple[float, float]:
    """(wall, thread CPU) microseconds per call."""
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner * 1e6, (time.thread_time() - c0) / inner * 1e6


def _job(rank: int, world_size: int, rounds: int, inner: int) -> dict:
    torch.manual_seed(0)
    xs = [torch.randn(ROWS, COLS) for _ in range(LIST)]
    ys = [torch.randn(ROWS, COLS) for _ in range(LIST)]
    stock_mesh = init_device_mesh("cpu", (world_size,))
    mesh = mesh_of_group(dist.group.WORLD, "cpu")

    def owned(t: torch.Tensor) -> OwnerDTensor:
        return OwnerDTensor.owned(t.clone() if rank == 0 else t[:0].clone(), 0, mesh, t.shape)

    layouts = {
        "plain": ([x.clone() for x in xs], [y.clone() for y in ys]),
        "stock DTensor": (
            [distribute_tensor(x, stock_mesh, [Shard(0)]) for x in xs],
            [distribute_tensor(y, stock_mesh, [Shard(0)]) for y in ys],
        ),
        "owner layout": ([owned(x) for x in xs], [owned(y) for y in ys]),
    }
    out: dict = {}
    with torch.no_grad():
        for op, fn in _ops().items():
            calls = {name: (lambda a=a, b=b, fn=fn: fn(a, b)) for name, (a, b) in layouts.items()}
            for call in calls.values():  # warm up (the first call of a metadata decides its rule)
                _sample(call, inner)
            samples: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
            for r in range(rounds):
                order = list(calls) if r % 2 == 0 else list(reversed(calls))
                for name in order:
                    samples[name].append(_sample(calls[name], inner))
            out[op] = {name: statistics.median(w for w, _ in s) for name, s in samples.items()}
            out[op].update({f"{name} (thread CPU)": statistics.median(c for _, c in s) for name, s in samples.items()})
    return out


def _table(ranks: list[dict], ops: list[str], before: dict | None, machine: str) -> dict:
    columns = [
        "operator",
        "plain",
        "stock DTensor",
        "owner, holder (rank 0)",
        "ratio holder / stock",
        "owner, non-holder (rank 1)",
        "ratio non-holder / stock",
        "thread CPU: stock, holder, non-holder",
        "thread CPU ratio holder / stock",
        "thread CPU ratio non-holder / stock",
    ]
    if before is not None:
        columns += ["before: holder", "before: non-holder"]
    rows = []
    for op in ops:
        r0, r1 = ranks[0][op], ranks[1][op]
        row: list[Any] = [
            op,
            round(r0["plain"], 1),
            round(r0["stock DTensor"], 1),
            round(r0["owner layout"], 1),
            round(r0["owner layout"] / r0["stock DTensor"], 2),
            round(r1["owner layout"], 1),
            round(r1["owner layout"] / r1["stock DTensor"], 2),
            f"{r0['stock DTensor (thread CPU)']:.1f}, {r0['owner layout (thread CPU)']:.1f}, "
            f"{r1['owner layout (thread CPU)']:.1f}",
            round(r0["owner layout (thread CPU)"] / r0["stock DTensor (thread CPU)"], 2),
            round(r1["owner layout (thread CPU)"] / r1["stock DTensor (thread CPU)"], 2),
        ]
        if before is not None:
            b = before.get(op)
            row += [round(b[0], 1) if b else "", round(b[1], 1) if b else ""]
        rows.append(row)
    return {
        "title": "Dispatch cost per operator call (microseconds, median of alternated rounds)",
        "columns": columns,
        "rows": rows,
        "note": (
            "2 gloo ranks on CPU, 64x64 float32, rank 0 holds the owner-layout tensors; stock DTensor is "
            "Shard(0) on the same ranks in the same run, each ratio against it on the same rank. "
            + f"Machine: {machine}; rounds alternate the layouts. "
            + (
                "'before' columns: the same rows before decisions were cached (an earlier run, not side by side)."
                if before is not None
                else ""
            )
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner", type=int, default=50)
    parser.add_argument("--before", type=Path, default=None, help="a JSON of an earlier run: its figures as columns")
    parser.add_argument(
        "--machine", default="2 CPU cores shared with other jobs (loaded)", help="the machine, for the table's note"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "dispatch_cost.json")
    args = parser.parse_args()
    ranks = spawn_ranks(_job, 2, args.rounds, args.inner)
    ops = list(_ops())
    before = None
    if args.before is not None:
        old = json.loads(args.before.read_text())["ranks"]
        before = {op: (old["0"][op]["owner layout"], old["1"][op]["owner layout"]) for op in ops if op in old["0"]}
    table = _table(ranks, ops, before, args.machine)
    result = {
        "what": "microseconds per call (median of alternated rounds), 2 gloo ranks on CPU, 64x64 float32; "
        "rank 0 holds the owner-layout tensors",
        "torch": torch.__version__,
        "rounds": args.rounds,
        "inner": args.inner,
        "ranks": {str(r): v for r, v in enumerate(ranks)},
        "tables": [table],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("| " + " | ".join(table["columns"]) + " |")
    print("|---|" + "---:|" * (len(table["columns"]) - 1))
    for row in table["rows"]:
        print("| " + " | ".join(str(c) for c in row) + " |")


if __name__ == "__main__":
    main()
