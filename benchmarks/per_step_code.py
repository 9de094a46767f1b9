"""Ordinary per-step code on the owner layout against stock FSDP2, in one run.

What a training script runs on the parameters besides forward, backward and the optimizer,
written as a user writes it, on two models (each with a gradient from one training step):
PyTorch's own test Transformer (``torch.testing._internal.distributed._tensor.common_dtensor``,
4 layers x dim 128, untied: 53 parameters) and the package's bench GPT (4 layers x 256). Two
layouts of the same model (same seed) on every rank:

* owner layout: the package's ``fully_shard`` on every block, then on the root, and
  ``OwnerRoutedOptimizer`` (Muon for the matrices, AdamW for the rest);
* stock FSDP2: ``torch.distributed.fsdp.fully_shard`` the same way, and ``torch.optim.AdamW``.

The per-step code, timed alone (rows of issue 40):

* EMA of the weights, a per-parameter loop: ``e.lerp_(p.detach(), 0.001)``;
* the same EMA as one ``torch._foreach_lerp_``;
* ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)``;
* a per-parameter gradient-norm log: ``p.grad.norm()`` per parameter, then one stacked read
  (``torch.stack(norms).full_tensor().tolist()``).

Gloo on CPU, ranks started with ``spawn_ranks`` as the other benchmarks start them, W=2 and W=4
in one invocation. Each round times every row on both layouts, the layouts in alternating order
(owner first in even rounds), each timed block started after a barrier; a sample is the slowest
rank's milliseconds per step (the code's collectives make the ranks wait on each other).
Reported per (model, W, row): medians over the rounds, the median of the per-round ratios
owner / stock and their interquartile range. Issue 40's bar: each ratio within 1.2x.

    python benchmarks/per_step_code.py               # W=2 and W=4, 20 rounds
    python benchmarks/per_step_code.py --rounds 5    # a quick look

Writes ``benchmarks/results/per_step_code.json`` (with a ``tables`` key for the docs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as stock_fully_shard
from torch.distributed.tensor import DTensor

from matrix_owner_optim import OwnerRoutedOptimizer
from matrix_owner_optim.sharding import fully_shard as owner_fully_shard
from matrix_owner_optim.toolbox.data import VOCAB
from matrix_owner_optim.toolbox.launch import spawn_ranks
from matrix_owner_optim.toolbox.models.gpt import GPT, GPTConfig

TARGET = 1.2  # issue 40: each row within 1.2x of stock FSDP2
LAYOUTS = ("owner", "stock")
MODELS = ("torch test Transformer 4 x 128", "bench GPT 4 x 256")
ROWS = (
    "EMA, per-parameter loop (e.lerp_(p.detach(), 0.001))",
    "EMA, one torch._foreach_lerp_",
    "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
    "grad-norm log (p.grad.norm() per parameter, one stacked read)",
)
BATCH, SEQ = 4, 32


def _read(t: torch.Tensor) -> list[float]:
    """One read of a (possibly distributed) tensor's values, on every rank."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).tolist()


def _ema_loop(model: nn.Module, ema: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for e, p in zip(ema, model.parameters(), strict=True):
            e.lerp_(p.detach(), 0.001)


def _ema_foreach(model: nn.Module, ema: list[torch.Tensor]) -> None:
    with torch.no_grad():
        torch._foreach_lerp_(ema, [p.detach() for p in model.parameters()], 0.001)


def _clip(model: nn.Module, ema: list[torch.Tensor]) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def _grad_norm_log(model: nn.Module, ema: list[torch.Tensor]) -> None:
    norms = [p.grad.norm() for p in model.parameters() if p.grad is not None]
    _read(torch.stack(norms))


CODE: dict[str, Callable[[nn.Module, list[torch.Tensor]], None]] = dict(
    zip(ROWS, (_ema_loop, _ema_foreach, _clip, _grad_norm_log), strict=True)
)


def _build(which: str, layout: str, world_size: int) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """The model ``which`` (seed 0) laid out as ``layout``, and its loss on a fixed batch."""
    torch.manual_seed(0)
    if which == MODELS[0]:
        from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

        args = ModelArgs(
            n_layers=4, dim=128, n_heads=4, vocab_size=64, max_seq_len=SEQ, dropout_p=0.0, weight_tying=False
        )
        model: nn.Module = Transformer(args)
        blocks = list(cast(nn.ModuleList, model.layers))
        vocab = args.vocab_size

        def loss_fn(m: nn.Module) -> torch.Tensor:
            return m(tokens).float().pow(2).mean()
    else:
        cfg = GPTConfig(vocab_size=len(VOCAB), seq_len=SEQ, n_layers=4, d_model=256, n_heads=4)
        model = GPT(cfg)
        blocks = list(model.layers)
        vocab = len(VOCAB)

        def loss_fn(m: nn.Module) -> torch.Tensor:
            return m(tokens, tokens)

    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    if layout == "owner":
        for b in blocks:
            owner_fully_shard(b)
        owner_fully_shard(model)
    else:
        mesh = init_device_mesh("cpu", (world_size,))
        for b in blocks:
            stock_fully_shard(b, mesh=mesh)
        stock_fully_shard(model, mesh=mesh)
    return model, loss_fn


def _optimizer(model: nn.Module, layout: str) -> torch.optim.Optimizer:
    if layout == "owner":
        return OwnerRoutedOptimizer(model, matrix="muon", matrix_options={"lr": 0.02}, tail="adamw")
    return torch.optim.AdamW(model.parameters(), lr=3e-3)


def _job(rank: int, world_size: int, rounds: int, inner: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for which in MODELS:
        sides: dict[str, tuple[nn.Module, list[torch.Tensor]]] = {}
        for layout in LAYOUTS:
            model, loss_fn = _build(which, layout, world_size)
            opt = _optimizer(model, layout)
            loss_fn(model).backward()
            opt.step()  # one training step: the plan fixed, the optimizer's state made
            opt.zero_grad()
            loss_fn(model).backward()  # the gradients the clip and the norm log read
            ema = [p.detach().clone() for p in model.parameters()]
            sides[layout] = (model, ema)
        times: dict[str, dict[str, list[float]]] = {row: {lay: [] for lay in LAYOUTS} for row in ROWS}
        for r in range(1 + rounds):  # round 0 warms up
            order = LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]
            for row, code in CODE.items():
                for layout in order:
                    model, ema = sides[layout]
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(inner):
                        code(model, ema)
                    ms = (time.perf_counter() - t0) / inner * 1e3
                    if r > 0:
                        times[row][layout].append(ms)
        out[which] = {"parameters": len(list(sides["owner"][0].parameters())), "times": times}
    return out


def _quartiles(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4)
    return {"q1": q[0], "median": statistics.median(xs), "q3": q[2]}


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per model and row: the slowest rank's sample per round, medians and ratios."""
    res: dict[str, Any] = {}
    for which in MODELS:
        rows: dict[str, Any] = {}
        for row in ROWS:
            per = {
                lay: [max(s) for s in zip(*(rk[which]["times"][row][lay] for rk in ranks), strict=True)]
                for lay in LAYOUTS
            }
            ratios = [o / s for o, s in zip(per["owner"], per["stock"], strict=True)]
            rows[row] = {
                "median_ms": {lay: statistics.median(per[lay]) for lay in LAYOUTS},
                "ratio_owner_vs_stock": _quartiles(ratios),
            }
        res[which] = {"parameters": ranks[0][which]["parameters"], "rows": rows}
    return res


def tables(results: dict[str, Any], rounds: int, inner: int) -> list[dict[str, Any]]:
    """One docs table: a row per (model, W, per-step code)."""
    rows = []
    for W, by_model in results.items():
        for which, res in by_model.items():
            for row, r in res["rows"].items():
                q = r["ratio_owner_vs_stock"]
                rows.append(
                    [
                        which,
                        int(W),
                        row,
                        round(r["median_ms"]["owner"], 2),
                        round(r["median_ms"]["stock"], 2),
                        round(q["median"], 2),
                        f"{q['q1']:.2f}..{q['q3']:.2f}",
                        "yes" if q["median"] <= TARGET else "no",
                    ]
                )
    note = (
        f"gloo on CPU, one thread per rank, {rounds} rounds after one warm-up round, each sample the "
        f"mean of {inner} calls and the slowest rank's; layouts alternated per round. Owner layout: the "
        "package's fully_shard (blocks, then root) + OwnerRoutedOptimizer; stock: torch's FSDP2 "
        "fully_shard + torch.optim.AdamW; one training step before timing. Ratio: median of the "
        f"per-round ratios owner / stock, IQR their quartiles; bar: within {TARGET}x. Milliseconds on a "
        "shared CPU are noise in absolute terms: read the ratios."
    )
    return [
        {
            "title": "Ordinary per-step code: owner layout against stock FSDP2 (ms per step)",
            "columns": [
                "model",
                "W",
                "per-step code",
                "owner ms",
                "stock ms",
                "ratio",
                "IQR of the ratio",
                "within bar",
            ],
            "rows": rows,
            "note": note,
        }
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--inner", type=int, default=2, help="calls per timed sample")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "per_step_code.json")
    args = ap.parse_args(argv)
    if args.rounds < 4:
        ap.error("--rounds must be >= 4 (quartiles of the per-round ratios)")
    if args.inner < 1 or any(w < 2 for w in args.world_sizes):
        ap.error("--inner must be >= 1 and every --world-sizes entry >= 2")
    load_before = os.getloadavg()
    results: dict[str, Any] = {}
    for W in args.world_sizes:
        results[str(W)] = summarize(spawn_ranks(_job, W, args.rounds, args.inner))
        for which, res in results[str(W)].items():
            print(f"W={W} {which} ({res['parameters']} parameters)")
            for row, r in res["rows"].items():
                q = r["ratio_owner_vs_stock"]
                print(
                    f"  {row:64s} owner {r['median_ms']['owner']:8.2f} ms  stock {r['median_ms']['stock']:8.2f} ms  "
                    f"ratio {q['median']:.2f} (IQR {q['q1']:.2f}..{q['q3']:.2f})"
                )
    out = {
        "what": "ordinary per-step code, owner layout vs stock FSDP2, ms per step (benchmarks/per_step_code.py)",
        "torch": torch.__version__,
        "host": {
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "load_average_before": list(load_before),
            "load_average_after": list(os.getloadavg()),
        },
        "config": {"rounds": args.rounds, "inner": args.inner, "batch": BATCH, "seq_len": SEQ},
        "target_ratio": TARGET,
        "results": results,
        "tables": tables(results, args.rounds, args.inner),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
