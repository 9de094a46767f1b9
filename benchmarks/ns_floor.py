"""Muon's optimizer step against the machine's matmul floor; where Shampoo's and SOAP's steps go.

Issue 41. One thread (``torch.set_num_threads(1)``), the 2D weight matrices of two models:
PyTorch's test Transformer at 4 layers x 256 (``torch.testing._internal...common_dtensor``:
16 of 256x256, 4 of 1024x256, 4 of 256x1024) and the bench's GPT at 4 x 256 (4 each of 768x256,
256x256, 1024x256, 256x1024). For each, in one process, alternated rounds (the order rotated
every round, so drift and other processes' load fall on every variant alike):

* the package's ``Muon`` batched (same-shape matrices through one stacked Newton-Schulz) and
  per-matrix (``batched=False``, the path kept bitwise ``torch.optim.Muon``), and
  ``torch.optim.Muon`` (bfloat16 Newton-Schulz only: torch has no other), on copies of the
  same parameters and gradients, every optimizer's defaults (lr 1e-3, weight decay 0.1);
* the floor: Newton-Schulz's matmuls at the rate this CPU reaches on each of them. Per s x l
  matrix (s the short side) an iteration runs three products, ``X X^T`` (s x l x s), ``A A``
  (s x s x s) and ``B X`` (s x s x l): ``ns_steps`` x (4 s^2 l + 2 s^3) FLOPs. Each distinct
  product shape of the step is timed in the same round in its four operand layouts (either
  operand row- or column-major); the floor is the sum over the step's products of its FLOPs at
  the fastest layout's rate. Beside it the *kernel floor*: the same products in the calls
  Newton-Schulz makes (``mm(X, X.mT)``, ``addmm(A, A, A, beta, alpha)``, ``addmm(X, B, X,
  beta)``, torch's Muon's), so ``kernel floor / step`` is the share of the step that is its own
  matmuls and ``floor / kernel floor`` what the kernels torch picks for those layouts leave on
  the table (on a CPU without bfloat16 matmul units, torch's bfloat16 ``A @ B`` with both
  operands row-major is a scalar loop, ~20x slower than ``A.mT @ B``). The batched path makes
  the fast form's calls where ``transposed_forms_pay`` (``mm(Xc.mT, Xc)``, ``addmm(A, A.mT, A)``,
  ``addmm(X, B.mT, X)``, every left operand column-major): its own kernel floor,
  ``batched_kernel_floor``, is those products' time.

Times are this thread's CPU time (``time.thread_time``: on a shared machine the time another
process holds the core is not the step's; wall-clock medians of the same steps are in the JSON).
Reported per case and dtype: median step time over rounds (each round's figure the median of
``--steps`` steps), the floor, efficiency = floor / step, and each package path's time over
torch's (median of the per-round ratios). The step includes everything an optimizer step does
(momentum, casts, norms, the update), the floors only the Newton-Schulz matmuls.

Shampoo and SOAP: one step of each on the test Transformer's matrices under ``torch.profiler``,
its self time split into matmuls, eigendecompositions / QR (the roots and bases), other aten
operations (elementwise, norms, copies), and the rest of the wall time (Python and dispatch),
for a step that recomputes roots / bases and one that reuses them; beside it the unprofiled
median step time.

    python benchmarks/ns_floor.py                 # 5 rounds, 3 steps each
    python benchmarks/ns_floor.py --rounds 1 --steps 1 --case "test Transformer 4x256"  # a look

Writes ``benchmarks/results/ns_floor.json`` (``tables`` for the docs site).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from matrix_owner_optim.preconditioners import SOAP, Muon, Shampoo
from matrix_owner_optim.preconditioners.newton_schulz import transposed_forms_pay

OUT = Path(__file__).parent / "results" / "ns_floor.json"
NS_STEPS = 5
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::dot", "aten::mv"}
DECOMPOSITION_OPS = {"aten::linalg_eigh", "aten::_linalg_eigh", "aten::linalg_qr", "aten::linalg_householder_product"}


def test_transformer_shapes() -> list[tuple[int, int]]:
    """The 2D weights of PyTorch's test Transformer (4 layers, dim 256) that Muon steps."""
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    model = Transformer(ModelArgs(n_layers=4, dim=256, n_heads=4))
    return [(p.shape[0], p.shape[1]) for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("layers.")]


def bench_gpt_shapes() -> list[tuple[int, int]]:
    """The 2D weights of the bench's GPT (``matrix-owner-optim bench``: 4 layers, width 256)."""
    from matrix_owner_optim.toolbox.models.gpt import GPT
    from matrix_owner_optim.toolbox.training import TrainConfig

    model = GPT(TrainConfig(n_layers=4, d_model=256, n_heads=4).model_config())
    return [(p.shape[0], p.shape[1]) for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("layers.")]


def ns_products(shapes: list[tuple[int, int]], ns_steps: int = NS_STEPS) -> Counter[tuple[str, int, int, int]]:
    """How many times the step runs each product ``(kind, m, k, n)`` (``m x k`` by ``k x n``):
    per s x l matrix and iteration ``X X^T`` ("gram", s x l x s), ``A A`` ("square", s x s x s)
    and ``B X`` ("apply", s x s x l)."""
    counts: Counter[tuple[str, int, int, int]] = Counter()
    for m, n in shapes:
        s, long = min(m, n), max(m, n)
        for product in (("gram", s, long, s), ("square", s, s, s), ("apply", s, s, long)):
            counts[product] += ns_steps
    return counts


def ns_flops(shapes: list[tuple[int, int]], ns_steps: int = NS_STEPS) -> int:
    """``ns_steps`` x (4 s^2 l + 2 s^3) per s x l matrix: the products of :func:`ns_products`."""
    return sum(count * 2 * m * k * n for (_, m, k, n), count in ns_products(shapes, ns_steps).items())


def _median_time(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def product_times(kind: str, m: int, k: int, n: int, dtype: torch.dtype, reps: int = 5) -> tuple[float, float, float]:
    """``(fastest layout, torch's call, the fast form's call)``: median thread CPU seconds of one
    ``m x k`` by ``k x n`` product in ``dtype``, the fastest of its four operand layouts and the
    calls torch's Newton-Schulz and the fast form make for ``kind`` (their operands' layouts,
    their fused ``addmm`` forms)."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=gen).to(dtype)
    lefts, rights = (a, a.mT.contiguous().mT), (b, b.mT.contiguous().mT)  # row- and column-major
    best = min(_median_time(partial(torch.mm, x, y), reps) for x in lefts for y in rights)
    out = torch.empty(m, n, dtype=dtype)
    calls = {
        "gram": partial(torch.mm, a, a.mT, out=out),  # X X^T
        "square": partial(torch.addmm, a, a, a, beta=-4.775, alpha=2.0315, out=out),  # b A + c A A
        "apply": partial(torch.addmm, b, a, b, beta=3.4445, out=out),  # a X + B X
    }
    columns = a.mT.contiguous()  # X column-major (its transpose row-major), as the fast form keeps it
    fast = {
        "gram": partial(torch.mm, columns.mT, columns, out=out),  # (X^T)^T X^T
        "square": partial(torch.addmm, a, a.mT, a, beta=-4.775, alpha=2.0315, out=out),  # b A + c A^T A
        "apply": partial(torch.addmm, b, a.mT, b, beta=3.4445, out=out),  # a X + B^T X
    }
    torch_call = _median_time(calls[kind], reps)
    fast_call = _median_time(fast[kind], reps) if transposed_forms_pay(a.device, dtype) else torch_call
    return best, torch_call, fast_call


def floors(shapes: list[tuple[int, int]], dtype: torch.dtype) -> tuple[float, float, float]:
    """``(floor, kernel floor, batched kernel floor)`` seconds of the step's Newton-Schulz
    products (module docstring)."""
    floor = kernel = fast = 0.0
    for (kind, m, k, n), count in ns_products(shapes).items():
        best, call, fast_call = product_times(kind, m, k, n, dtype)
        floor, kernel, fast = floor + count * best, kernel + count * call, fast + count * fast_call
    return floor, kernel, fast


def _params(shapes: list[tuple[int, int]], seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


def _median_step(opt: torch.optim.Optimizer, steps: int) -> tuple[float, float]:
    """Medians of ``steps`` steps' thread CPU and wall-clock times."""
    cpu, wall = [], []
    for _ in range(steps):
        c0, w0 = time.thread_time(), time.perf_counter()
        opt.step()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall)


def muon_case(shapes: list[tuple[int, int]], dtype: torch.dtype, rounds: int, steps: int) -> dict[str, Any]:
    """Median step times of every variant and the floors, alternated rounds."""
    makers: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "batched": lambda: Muon(_params(shapes), ns_dtype=dtype, batched=True),
        "per_matrix": lambda: Muon(_params(shapes), ns_dtype=dtype, batched=False),
    }
    if dtype == torch.bfloat16:
        makers["torch"] = lambda: torch.optim.Muon(_params(shapes))
    opts = {name: make() for name, make in makers.items()}
    for opt in opts.values():  # warm-up: state, oneDNN primitives, allocator
        opt.step()
        opt.step()
    per: dict[str, list[float]] = {name: [] for name in [*opts, "floor", "kernel_floor", "batched_kernel_floor"]}
    wall: dict[str, list[float]] = {name: [] for name in opts}
    names = list(opts)
    for r in range(rounds):
        # rotated, so every variant takes every place in a round equally often and none runs
        # twice in a row across rounds (the one that does finds its tensors warm in cache)
        order = names[r % len(names) :] + names[: r % len(names)]
        floor, kernel, fast = floors(shapes, dtype)
        per["floor"].append(floor)
        per["kernel_floor"].append(kernel)
        per["batched_kernel_floor"].append(fast)
        for name in order:
            cpu, clock = _median_step(opts[name], steps)
            per[name].append(cpu)
            wall[name].append(clock)
    flops = ns_flops(shapes)
    out: dict[str, Any] = {"matrices": len(shapes), "ns_flops": flops}
    out["median_s"] = {k: statistics.median(v) for k, v in per.items()}
    out["wall_median_s"] = {k: statistics.median(v) for k, v in wall.items()}
    out["matmul_rate_gflops"] = flops / out["median_s"]["floor"] / 1e9
    out["kernel_rate_gflops"] = flops / out["median_s"]["kernel_floor"] / 1e9
    out["efficiency"] = {k: out["median_s"]["floor"] / out["median_s"][k] for k in opts}
    out["kernel_efficiency"] = {  # each path against the products in its own calls
        k: out["median_s"]["batched_kernel_floor" if k == "batched" else "kernel_floor"] / out["median_s"][k]
        for k in opts
    }
    if "torch" in opts:
        out["vs_torch"] = {
            k: statistics.median(a / t for a, t in zip(per[k], per["torch"], strict=True))
            for k in ("batched", "per_matrix")
        }
    out["rounds_s"] = per
    out["wall_rounds_s"] = wall
    return out


def _profile_split(opt: torch.optim.Optimizer) -> dict[str, float]:
    """One profiled step: self time by category, as fractions of the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        opt.step()
        wall = time.perf_counter() - t0  # wall, as the profiler's own times
    split = {"matmul": 0.0, "eigh_qr": 0.0, "other_aten": 0.0}
    for ev in prof.key_averages():
        if not ev.key.startswith("aten::"):
            continue
        us = ev.self_cpu_time_total / 1e6
        if ev.key in MATMUL_OPS:
            split["matmul"] += us
        elif ev.key in DECOMPOSITION_OPS or "eigh" in ev.key or "qr" in ev.key or "geqrf" in ev.key:
            split["eigh_qr"] += us
        else:
            split["other_aten"] += us
    split["python_dispatch"] = max(0.0, wall - sum(split.values()))
    return {k: v / wall for k, v in split.items()} | {"profiled_wall_s": wall}


def preconditioner_breakdown(shapes: list[tuple[int, int]], steps: int) -> list[dict[str, Any]]:
    """Shampoo's and SOAP's step on ``shapes``: a step that recomputes roots/bases, one that reuses them."""
    rows = []
    cases: dict[str, tuple[Callable[[list[nn.Parameter]], torch.optim.Optimizer], int, int]] = {
        # roots every step (Shampoo's default precondition_frequency=1)
        "Shampoo, roots recomputed": (lambda ps: Shampoo(ps), 1, 1),
        # roots from step 1, reused for 99 steps
        "Shampoo, roots reused": (
            lambda ps: Shampoo(ps, precondition_frequency=100, start_preconditioning_step=1),
            1,
            1,
        ),
        # bases refreshed every step (one power step + QR per side)
        "SOAP, bases refreshed": (lambda ps: SOAP(ps, precondition_frequency=1), 2, 1),
        # SOAP's default precondition_frequency=10: 9 of 10 steps reuse the bases
        "SOAP, bases reused": (lambda ps: SOAP(ps, precondition_frequency=1000), 2, 1),
    }
    for name, (make, warm, _) in cases.items():
        opt = make(_params(shapes))
        for _ in range(warm):
            opt.step()
        cpu, _ = _median_step(opt, steps)
        split = _profile_split(opt)
        rows.append({"case": name, "median_s": cpu, **split})
    return rows


def tables(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for case, by_dtype in results["muon"].items():
        for dtype, r in by_dtype.items():
            ms = r["median_s"]
            vs = r.get("vs_torch", {})
            rows.append(
                [
                    case,
                    dtype,
                    round(ms["batched"] * 1e3, 1),
                    round(ms["per_matrix"] * 1e3, 1),
                    round(ms["torch"] * 1e3, 1) if "torch" in ms else "n/a",
                    round(ms["floor"] * 1e3, 1),
                    round(ms["kernel_floor"] * 1e3, 1),
                    round(ms["batched_kernel_floor"] * 1e3, 1),
                    round(r["matmul_rate_gflops"], 1),
                    round(r["efficiency"]["batched"], 2),
                    round(r["efficiency"]["per_matrix"], 2),
                    round(r["kernel_efficiency"]["batched"], 2),
                    round(vs["batched"], 2) if vs else "n/a",
                    round(vs["per_matrix"], 2) if vs else "n/a",
                ]
            )
    muon_table = {
        "title": "Muon step vs the Newton-Schulz matmul floor (one thread)",
        "columns": [
            "matrices",
            "ns_dtype",
            "batched ms",
            "per-matrix ms",
            "torch.optim.Muon ms",
            "floor ms",
            "kernel floor ms",
            "batched kernel floor ms",
            "floor GFLOP/s",
            "efficiency batched",
            "efficiency per-matrix",
            "batched / kernel floor",
            "batched / torch",
            "per-matrix / torch",
        ],
        "rows": rows,
        "note": (
            "Thread CPU time, medians over alternated rounds in one process; floor = the step's Newton-Schulz "
            "products at the rate of each product's fastest operand layout, kernel floor = the same products in "
            "torch's Newton-Schulz calls (the per-matrix path's), batched kernel floor = in the batched path's "
            "(its fast form), all measured in the same rounds; efficiency = floor / step; batched / kernel "
            "floor = the batched path against its own calls; "
            "ratios = medians of per-round ratios. torch.optim.Muon runs bfloat16 only. "
            f"{results['config']['load']}"
        ),
    }
    pre_rows = [
        [
            r["case"],
            round(r["median_s"] * 1e3, 1),
            round(100 * r["matmul"]),
            round(100 * r["eigh_qr"]),
            round(100 * r["other_aten"]),
            round(100 * r["python_dispatch"]),
        ]
        for r in results["preconditioners"]
    ]
    pre_table = {
        "title": "Shampoo and SOAP: where a step's time goes (test Transformer 4x256 matrices, one thread)",
        "columns": ["step", "median ms", "matmul %", "eigh / QR %", "other aten %", "Python + dispatch %"],
        "rows": pre_rows,
        "note": (
            "Shares of one profiled step's wall time (torch.profiler self times; the remainder "
            "is Python and dispatch); median ms unprofiled, thread CPU time. Defaults but precondition_frequency as named."
        ),
    }
    return [muon_table, pre_table]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--case", action="append", help="only this matrix set (repeatable; default: both)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1:
        raise SystemExit("--rounds and --steps must be >= 1")
    torch.set_num_threads(1)
    load = os.getloadavg()
    cases = {"test Transformer 4x256": test_transformer_shapes(), "bench GPT 4x256": bench_gpt_shapes()}
    if args.case:
        unknown = set(args.case) - set(cases)
        if unknown:
            raise SystemExit(f"unknown --case {sorted(unknown)}; known: {sorted(cases)}")
        cases = {name: shapes for name, shapes in cases.items() if name in args.case}
    results: dict[str, Any] = {"config": {"rounds": args.rounds, "steps": args.steps, "threads": 1}, "muon": {}}
    for case, shapes in cases.items():
        results["muon"][case] = {}
        for dtype in (torch.bfloat16, torch.float32):
            r = muon_case(shapes, dtype, args.rounds, args.steps)
            results["muon"][case][str(dtype).removeprefix("torch.")] = r
            ms = r["median_s"]
            print(
                f"{case:24s} {dtype}: "
                + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in ms.items())
                + "  eff "
                + " ".join(f"{k} {v:.2f}" for k, v in r["efficiency"].items())
                + (
                    "  vs torch " + " ".join(f"{k} {v:.2f}" for k, v in r["vs_torch"].items())
                    if "vs_torch" in r
                    else ""
                ),
                flush=True,
            )
    results["preconditioners"] = preconditioner_breakdown(test_transformer_shapes(), min(args.steps, 3))
    for r in results["preconditioners"]:
        print(
            f"{r['case']:28s} {r['median_s'] * 1e3:.1f} ms  "
            + " ".join(f"{k} {v:.2f}" for k, v in r.items() if k not in ("case", "median_s"))
        )
    end = os.getloadavg()
    results["config"]["load"] = (
        f"Machine load average (2 cores, shared) {load[0]:.1f} at the start, {end[0]:.1f} at the end."
    )
    results["tables"] = tables(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
