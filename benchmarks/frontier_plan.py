"""Plans at frontier scale: how long planning and a rank's plan fix take on torchtitan's own configs.

Three models are built on the meta device from torchtitan 0.3.0's configs
(``llama3_configs["405B"]``, ``qwen3_configs["235B-A22B"]``, ``deepseekv3_configs["671B"]``),
each in a fresh process, and timed in three columns:

* ``plan_model`` at W=256 and at W=2048 (one unit: the model as it is built);
* a rank fixes its plan at W=2048: ``dist.init_process_group("fake", ..., rank=3,
  world_size=2048)`` (torch's in-process fake process group), the package's ``fully_shard`` on
  each block and the root, ``OwnerRoutedOptimizer(model, matrix="muon", tail="adamw")``: the
  specs, the planner, the agreement digest, the metadata per tensor, the relayout on meta and the
  optimizer's construction, what every rank of a 2048-GPU job spends at start-up.

Each cell reports wall and CPU seconds (the machine may be shared: CPU time is what the process
itself spent) and the plan's balance (bytes / FLOPs max over mean). ``--before SRC`` times another
source tree (``SRC`` holds ``matrix_owner_optim``, e.g. ``git archive <commit> src``) side by side:
rounds alternate (after, before, before, after, ...) and the medians are reported; a cell of the
other tree that runs past ``--before-timeout`` is reported as such.

    python benchmarks/frontier_plan.py                          # this tree, 3 rounds
    python benchmarks/frontier_plan.py --before /tmp/base/src   # side by side with another tree

Writes ``benchmarks/results/frontier_plan.json`` (with a ``tables`` key).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODELS = {
    "llama3_405b": "Llama-3 405B",
    "qwen3_235b_a22b": "Qwen3-235B-A22B",
    "deepseek_v3_671b": "DeepSeek-V3 671B",
}
COLUMNS = ("plan_256", "plan_2048", "rank_fix_2048")
RESULTS = Path(__file__).resolve().parent / "results" / "frontier_plan.json"


def build(model: str) -> Any:
    """The torchtitan model ``model`` (a key of :data:`MODELS`) on the meta device."""
    import torch
    import torchtitan.models.deepseek_v3 as deepseek_v3
    import torchtitan.models.llama3 as llama3
    import torchtitan.models.qwen3 as qwen3

    if model == "llama3_405b":
        config = llama3.llama3_configs["405B"](attn_backend="flex")
    elif model == "qwen3_235b_a22b":
        config = qwen3.qwen3_configs["235B-A22B"](attn_backend="flex")
    elif model == "deepseek_v3_671b":
        config = deepseek_v3.deepseekv3_configs["671B"](attn_backend="flex", moe_comm_backend="standard")
    else:
        raise ValueError(f"unknown model {model!r}; use one of {', '.join(MODELS)}")
    with torch.device("meta"):
        return config.build()


def fix_on_fake_rank(model: Any, world_size: int = 2048, rank: int = 3) -> Any:
    """What one rank does to fix its plan: ``fully_shard`` on each block and the root under the
    fake process group, then the optimizer (which fixes the plan). Returns the optimizer."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import matrix_owner_optim as moo

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    for block in model.layers.values():
        moo.fully_shard(block)
    moo.fully_shard(model)
    return moo.OwnerRoutedOptimizer(model, matrix="muon", tail="adamw")


def _matrices(plan: Any) -> int:
    return sum(int(s.shape[0]) if len(s.shape) == 3 else 1 for s in plan if s.role.value == "matrix")


def _worker(model_name: str, column: str) -> dict[str, Any]:
    """One cell, in this (fresh) process."""
    import matrix_owner_optim as moo

    model = build(model_name)
    wall, cpu = time.perf_counter(), time.process_time()
    if column == "rank_fix_2048":
        from matrix_owner_optim.sharding.state import state_of

        fix_on_fake_rank(model)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        state = state_of(model)
        assert state is not None
        plan = state.fix_plan().plan  # fixed already: returns the tree's context
    else:
        plan = moo.plan_model(model, 256 if column == "plan_256" else 2048)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    imbalance = plan.imbalance()
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "bytes_max_over_mean": imbalance["bytes_max_over_mean"],
        "flops_max_over_mean": imbalance["flops_max_over_mean"],
        "matrices": _matrices(plan),
        "digest": plan.digest(),
    }


def _cell(src: str, model: str, column: str, timeout: float) -> dict[str, Any] | None:
    env = {**os.environ, "PYTHONPATH": src}
    cmd = [sys.executable, __file__, "--worker", model, column]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
        return None
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{model} {column} under {src} failed:\n{e.stderr[-3000:]}") from None
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fmt(cells: list[dict[str, Any] | None], key: str, timeout: float) -> str | float:
    done = [c[key] for c in cells if c is not None]
    if len(done) < len(cells):
        return f"> {timeout:.0f}"
    return round(statistics.median(done), 2)


def _balance(cells: list[dict[str, Any] | None]) -> str:
    done = [c for c in cells if c is not None]
    if not done:
        return "-"
    return f"{done[0]['bytes_max_over_mean']:.3f} / {done[0]['flops_max_over_mean']:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "COLUMN"), help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per tree (default 3)")
    parser.add_argument("--before", metavar="SRC", help="another source tree to time side by side")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per cell of this tree (default 600)")
    parser.add_argument(
        "--before-timeout", type=float, default=60.0, help="seconds per cell of the --before tree (default 60)"
    )
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated keys of MODELS")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results JSON")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(*args.worker)))
        return
    after_src = str(Path(__file__).resolve().parent.parent / "src")
    trees = {"after": after_src, **({"before": args.before} if args.before else {})}
    models = [m for m in args.models.split(",") if m]
    cells: dict[str, dict[tuple[str, str], list[dict[str, Any] | None]]] = {t: {} for t in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for model in models:
            for column in COLUMNS:
                for tree in order:
                    limit = args.timeout if tree == "after" else args.before_timeout
                    cell = _cell(trees[tree], model, column, limit)
                    cells[tree].setdefault((model, column), []).append(cell)
                    shown = "timeout" if cell is None else f"{cell['wall_s']:.2f} s wall, {cell['cpu_s']:.2f} s cpu"
                    print(f"round {r} {tree:6s} {model:18s} {column:14s} {shown}", flush=True)
    load = os.getloadavg()
    tables = []
    for tree in trees:
        rows = []
        for model in models:
            got = [cells[tree][(model, c)] for c in COLUMNS]
            matrices = next((c["matrices"] for col in got for c in col if c is not None), "-")
            row: list[str | float | int] = [MODELS[model], matrices]
            limit = args.timeout if tree == "after" else args.before_timeout
            for col in got:
                row += [_fmt(col, "wall_s", limit), _fmt(col, "cpu_s", limit), _balance(col)]
            rows.append(row)
        columns = ["model", "matrices"]
        for c in ("plan_model W=256", "plan_model W=2048", "rank fixes its plan W=2048"):
            columns += [f"{c}: wall s", f"{c}: CPU s", f"{c}: bytes / FLOPs max/mean"]
        tables.append(
            {
                "title": f"Frontier plans ({tree}: {trees[tree]})",
                "columns": columns,
                "rows": rows,
                "note": f"Median of {args.rounds} rounds, each cell a fresh process, rounds alternating "
                f"between the trees; load average at the end {load[0]:.1f} on {os.cpu_count()} cores "
                f"(a shared machine: wall time carries the load, CPU time is the process's own). "
                "'> N': the cell ran past its timeout of N seconds (wall).",
            }
        )
    digests = {tree: {f"{m} {c}": (v[0] or {}).get("digest") for (m, c), v in cells[tree].items()} for tree in trees}
    result = {
        "rounds": args.rounds,
        "trees": trees,
        "digests": digests,
        "cells": {tree: {f"{m} {c}": v for (m, c), v in cells[tree].items()} for tree in trees},
        "tables": tables,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
