"""One-command device check of the owner layout: exactness, a side-by-side timing, a profile.

    torchrun --nproc_per_node=1 benchmarks/device_check.py --out runs/device_w1
    torchrun --nproc_per_node=N benchmarks/device_check.py --out runs/device_wN

On CUDA each rank uses ``cuda:LOCAL_RANK`` and NCCL (``--device cpu`` runs the same checks on
gloo, which is how the script itself is tested). It writes ``device_check.json`` (and a Chrome
trace of two owner-layout steps) under ``--out`` and exits non-zero if a check fails:

1. exactness: the tiny GPT on the owner layout with AdamW, and with OwnerRoutedOptimizer(Muon,
   float32 Newton-Schulz), against the same optimizer on the unsharded model over the global
   batch, 8 steps: final parameters within ``--rtol`` (TF32 off); the optimizer step issues no
   collective (CommCounter);
2. timing: owner layout + OwnerRoutedOptimizer(Muon) vs stock FSDP2 + ``torch.optim.Muon`` on a
   larger GPT, median step and optimizer-step times, and the bytes per phase this package sends
   (CommCounter; stock FSDP2's own collectives are not counted there);
3. profile: the fraction of communication-kernel time that overlaps compute kernels (CUDA
   only: what a separate communication stream would raise).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from matrix_owner_optim import CommCounter, OwnerRoutedOptimizer, fully_shard
from matrix_owner_optim.comm import comm_phase
from matrix_owner_optim.toolbox.models.gpt import GPT, GPTConfig
from matrix_owner_optim.toolbox.training import synchronize


def _batch(
    step: int, rank: int, W: int, cfg: GPTConfig, micro: int, device: torch.device, whole: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, cfg.vocab_size, (W * micro, cfg.seq_len), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (W * micro, cfg.seq_len), generator=g)
    if not whole:
        idx, tgt = idx[rank * micro : (rank + 1) * micro], tgt[rank * micro : (rank + 1) * micro]
    return idx.to(device), tgt.to(device)


def _shard(model: GPT) -> GPT:
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def exactness(rank: int, W: int, device: torch.device, rtol: float) -> dict[str, Any]:
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, d_model=32, n_heads=2)
    out: dict[str, Any] = {}
    for kind in ("adamw", "muon"):
        torch.manual_seed(0)
        ref = GPT(cfg).to(device)
        # AdamW's model is built on the CPU: fully_shard moves it to the mesh's device (FSDP2)
        model = _shard(copy.deepcopy(ref).cpu() if kind == "adamw" else copy.deepcopy(ref))
        on_device = all(t.device == device for t in [*model.parameters(), *model.buffers()])
        adamw = {"lr": 1e-2, "eps": 1e-5}
        if kind == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), **adamw)
            ref_opt: torch.optim.Optimizer = torch.optim.AdamW(ref.parameters(), **adamw)
        else:
            muon = {"lr": 0.02, "ns_dtype": torch.float32}
            opt = OwnerRoutedOptimizer(model, matrix="muon", matrix_options=muon, tail="adamw", tail_options=adamw)
            ref_opt = OwnerRoutedOptimizer(ref, matrix="muon", matrix_options=muon, tail="adamw", tail_options=adamw)
        optimizer_calls = 0
        for step in range(8):
            model(*_batch(step, rank, W, cfg, 2, device)).backward()
            with CommCounter() as cc, comm_phase("optimizer"):
                opt.step()
            optimizer_calls += cc.calls()
            opt.zero_grad()
            ref(*_batch(step, rank, W, cfg, 2, device, whole=True)).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        worst = 0.0
        ref_params = dict(ref.named_parameters())
        model.unshard()
        for name, p in model.named_parameters():
            q = ref_params[name]
            worst = max(worst, float((p.double() - q.double()).norm() / q.double().norm().clamp_min(1e-30)))
        model.reshard()
        out[kind] = {
            "max_rel_err": worst,
            "optimizer_collectives": optimizer_calls,
            "on_mesh_device": on_device,
            "ok": worst <= rtol and optimizer_calls == 0 and on_device,
        }
    return out


def timing(rank: int, W: int, device: torch.device, layers: int, width: int, steps: int) -> dict[str, Any]:
    cfg = GPTConfig(vocab_size=512, seq_len=128, n_layers=layers, d_model=width, n_heads=max(1, width // 64))
    rows: dict[str, Any] = {}
    for row in ("owner", "fsdp2"):
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        if row == "owner":
            _shard(model)
            opt: Any = OwnerRoutedOptimizer(
                model, matrix="muon", matrix_options={"lr": 0.02}, tail="adamw", tail_options={"lr": 3e-3}
            )
            opts = [opt]
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard as stock_fully_shard

            mesh = init_device_mesh(device.type, (W,))
            for block in model.layers:
                stock_fully_shard(block, mesh=mesh)
            stock_fully_shard(model, mesh=mesh)
            mats = [p for n, p in model.named_parameters() if p.ndim == 2 and "wte" not in n and "wpe" not in n]
            rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "wte" not in n and "wpe" not in n)]
            opts = [torch.optim.Muon(mats, lr=0.02), torch.optim.AdamW(rest, lr=3e-3)]
        step_s, opt_s = [], []
        with CommCounter() as cc:
            for step in range(steps):
                synchronize(device)
                t0 = time.perf_counter()
                with comm_phase("forward"):
                    loss = model(*_batch(step, rank, W, cfg, 4, device))
                with comm_phase("backward"):
                    loss.backward()
                synchronize(device)
                t1 = time.perf_counter()
                with comm_phase("optimizer"):
                    for o in opts:
                        o.step()
                synchronize(device)
                t2 = time.perf_counter()
                for o in opts:
                    o.zero_grad()
                step_s.append(t2 - t0)
                opt_s.append(t2 - t1)
        rows[row] = {
            "median_step_s": statistics.median(step_s[2:]),
            "median_optimizer_s": statistics.median(opt_s[2:]),
            "package_bytes_sent_per_step": {k: v["bytes_sent"] / steps for k, v in cc.by_phase().items()},
        }
    rows["optimizer_ratio_owner_vs_fsdp2"] = rows["owner"]["median_optimizer_s"] / rows["fsdp2"]["median_optimizer_s"]
    return rows


def profile_overlap(rank: int, W: int, device: torch.device, out: Path) -> dict[str, Any]:
    """Fraction of communication-kernel time overlapping compute kernels on the GPU."""
    if device.type != "cuda":
        return {"skipped": "no CUDA device: kernel overlap is a GPU measurement"}
    from torch.profiler import ProfilerActivity, profile

    cfg = GPTConfig(vocab_size=512, seq_len=128, n_layers=4, d_model=512, n_heads=8)
    torch.manual_seed(0)
    model = _shard(GPT(cfg).to(device))
    for step in range(2):  # warm-up, records the prefetch order
        model(*_batch(step, rank, W, cfg, 4, device)).backward()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for step in range(2):
            model(*_batch(step, rank, W, cfg, 4, device)).backward()
        synchronize(device)
    prof.export_chrome_trace(str(out / f"trace_rank{rank}.json"))
    comm, compute = [], []
    for e in prof.events():
        if e.device_type.name != "CUDA" or e.time_range.elapsed_us() <= 0:
            continue
        span = (e.time_range.start, e.time_range.end)
        (comm if "nccl" in e.name.lower() else compute).append(span)
    total = sum(b - a for a, b in comm)
    overlapped = sum(max(0, min(b, d) - max(a, c)) for a, b in comm for c, d in compute)
    return {
        "comm_kernel_us": total,
        "overlapped_us": overlapped,
        "overlap_fraction": overlapped / total if total else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=Path("runs/device_check"))
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device, local_rank) if args.device == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        result = {
            "world_size": W,
            "device": str(device),
            "torch": torch.__version__,
            "exactness": exactness(rank, W, device, args.rtol),
            "timing": timing(rank, W, device, args.layers, args.width, args.steps),
            "profile": profile_overlap(rank, W, device, args.out),
        }
    finally:
        dist.destroy_process_group()
    ok = all(v["ok"] for v in result["exactness"].values())
    if rank == 0:
        (args.out / "device_check.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
