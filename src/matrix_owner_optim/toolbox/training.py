"""The training loop behind ``matrix-owner-optim train`` and ``bench``, one rank at a time.

:func:`train_rank` builds the built-in GPT with a fixed seed, shards it with the requested
layout (``owner``: this package's owner-shaped ``fully_shard``; ``owner_hsdp``: the same on a
(2, W/2) mesh, one global owner per matrix; ``owner_hsdp_replicas``: that mesh with every
replica stepping what it holds, as before global owners; ``fsdp2``: stock
``torch.distributed.fsdp.fully_shard``; ``ddp``; or one process), builds the requested
optimizer, and trains on the embedded arithmetic corpus. Every step it records the loss, the
step and optimizer-step times and the bytes of every phase (:class:`CommCounter` for our
collectives; ``torch.profiler`` for stock FSDP2's, on the profiled step).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from .. import comm
from ..comm import CommCounter, comm_phase
from ..optim import OwnerRoutedOptimizer
from ..planning.metadata import Role
from ..planning.roles import module_roles
from .baselines import ReconstructionMuon, ReconstructionOptimizer
from .data import VOCAB, BatchSampler, arithmetic_corpus
from .models import GPT, GPTConfig
from .profiling import backend_ops, native_stderr_without_usdt, op_bytes, phase_windows

__all__ = ["TrainConfig", "train_rank", "LAYOUTS", "OPTIMIZERS", "resident_bytes", "synchronize"]

LAYOUTS = ("owner", "owner_hsdp", "owner_hsdp_replicas", "fsdp2", "ddp", "single")
# owner-routed: muon/shampoo/soap/adamw; baselines: torch_muon (stock torch.optim.Muon on the
# layout's tensors) and reconstruction (all-gather every full update, NS everywhere).
OPTIMIZERS = (
    "muon",
    "shampoo",
    "soap",
    "adamw",
    "torch_muon",
    "torch_adamw",
    "reconstruction",
    "reconstruction_shampoo",
    "reconstruction_soap",
)

MATRIX_LR = {
    "muon": 0.02,
    "shampoo": 0.003,
    "soap": 0.003,
    "adamw": 0.003,
    "torch_muon": 0.02,
    "torch_adamw": 0.003,
    "reconstruction": 0.02,
    "reconstruction_shampoo": 0.003,
    "reconstruction_soap": 0.003,
}


@dataclass
class TrainConfig:
    layout: str = "owner"
    optimizer: str = "muon"
    steps: int = 100
    global_batch: int = 16
    seq_len: int = 32
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    tail_lr: float = 3e-3
    matrix_lr: float | None = None
    warmup: int = 10
    seed: int = 0
    ns_dtype: str = "float32"
    profile_step: int | None = 1  # profile this step with torch.profiler (backend op bytes)
    progress: bool = False
    corpus_lines: int = 20000
    device: str = "cpu"  # "cuda" under torchrun on GPUs: each rank uses cuda:<LOCAL_RANK>
    replica_broadcast: str | None = None  # owner_hsdp: "step" or "forward" (None: the optimizer's default)

    def model_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=len(VOCAB),
            seq_len=self.seq_len,
            n_layers=self.n_layers,
            d_model=self.d_model,
            n_heads=self.n_heads,
        )

    def validate(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r}: use one of {LAYOUTS}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r}: use one of {OPTIMIZERS}")
        if self.optimizer.startswith("reconstruction") and self.layout != "fsdp2":
            raise ValueError("optimizer 'reconstruction' is the stock-FSDP2 baseline: use --layout fsdp2")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")

    def check_world_size(self, world_size: int) -> None:
        if self.layout.startswith("owner_hsdp") and (world_size < 2 or world_size % 2):
            raise ValueError(
                f"layout {self.layout!r} runs on a (2, W/2) mesh: use an even world size >= 2, got {world_size}"
            )


def _schedule(cfg: TrainConfig):
    def factor(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _shard(model: GPT, cfg: TrainConfig, world_size: int, device: torch.device) -> nn.Module:
    if cfg.layout == "single" or world_size == 1 and cfg.layout != "owner":
        return model
    if cfg.layout == "owner":
        from ..sharding import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        return model
    if cfg.layout.startswith("owner_hsdp"):
        from torch.distributed.device_mesh import init_device_mesh

        from ..planning import plan_model
        from ..sharding import fully_shard

        mesh = init_device_mesh(device.type, (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
        # a plan without step replicas: every replica steps what it holds (HSDP before global owners)
        plan = (
            plan_model(model, world_size // 2, unit_prefixes=model.unit_prefixes())
            if cfg.layout == "owner_hsdp_replicas"
            else None
        )
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh, plan=plan)
        return model
    if cfg.layout == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as stock_fully_shard

        mesh = init_device_mesh(device.type, (world_size,))
        for block in model.layers:
            stock_fully_shard(block, mesh=mesh)
        stock_fully_shard(model, mesh=mesh)
        return model
    return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def _optimizers(model: nn.Module, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    base = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    ns_dtype = getattr(torch, cfg.ns_dtype)
    mlr = cfg.matrix_lr if cfg.matrix_lr is not None else MATRIX_LR[cfg.optimizer]
    if cfg.optimizer in ("muon", "shampoo", "soap", "adamw"):
        opts: dict[str, Any] = {"lr": mlr}
        if cfg.optimizer == "muon":
            opts.update(ns_dtype=ns_dtype, weight_decay=0.0)
        extra: dict[str, Any] = {} if cfg.replica_broadcast is None else {"replica_broadcast": cfg.replica_broadcast}
        return [
            OwnerRoutedOptimizer(
                base,
                matrix=cfg.optimizer,
                matrix_options=opts,
                tail="adamw",
                tail_options={"lr": cfg.tail_lr, "weight_decay": 0.0},
                **extra,
            )
        ]
    if cfg.optimizer == "torch_adamw":
        return [torch.optim.AdamW(base.parameters(), lr=cfg.tail_lr, weight_decay=0.0)]
    roles = module_roles(base)
    mats = [p for p in base.parameters() if roles[id(p)] is Role.MATRIX]
    rest = [p for p in base.parameters() if roles[id(p)] is not Role.MATRIX]
    if cfg.optimizer == "torch_muon":
        matrix_opt: torch.optim.Optimizer = torch.optim.Muon(mats, lr=mlr, weight_decay=0.0)
    elif cfg.optimizer == "reconstruction":
        matrix_opt = ReconstructionMuon(mats, lr=mlr, weight_decay=0.0, ns_dtype=ns_dtype)
    else:
        from ..preconditioners import SOAP, Shampoo

        inner = Shampoo if cfg.optimizer == "reconstruction_shampoo" else SOAP
        matrix_opt = ReconstructionOptimizer(mats, inner, lr=mlr)
    return [matrix_opt, torch.optim.AdamW(rest, lr=cfg.tail_lr, weight_decay=0.0)]


def _local_nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def resident_bytes(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, int]:
    """Bytes this rank keeps between steps: parameters, gradients, optimizer state, and the
    working copies an optimizer keeps (``extra``: owners' full matrices on stock FSDP2,
    replicas of the reconstruction baselines). Scalar state (step counters) is not counted,
    as the planner does not count it."""
    params = {id(p): p for p in model.parameters()}.values()
    out = {
        "params": sum(_local_nbytes(p) for p in params),
        "grads": sum(_local_nbytes(p.grad) for p in params),
        "optimizer_state": 0,
        "extra": 0,
    }
    seen: set[int] = set()
    for opt in optimizers:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and id(v) not in seen:
                    seen.add(id(v))
                    out["optimizer_state"] += _local_nbytes(v)
        extra = getattr(opt, "extra_resident_bytes", None)
        if callable(extra):
            out["extra"] += int(extra())
    out["total"] = out["params"] + out["grads"] + out["optimizer_state"] + out["extra"]
    return out


def _rank_device(kind: str) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but CUDA is not available")
        index = int(os.environ.get("LOCAL_RANK", "0"))  # set by torchrun for each process
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    raise ValueError(f"device {kind!r}: use 'cpu' or 'cuda'")


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so wall-clock timings measure it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_rank(rank: int, world_size: int, cfg: TrainConfig) -> dict[str, Any]:
    """Train on this rank; returns per-step records (identical keys on every rank)."""
    cfg.validate()
    cfg.check_world_size(world_size)
    torch.manual_seed(cfg.seed)
    device = _rank_device(cfg.device)
    model = _shard(GPT(cfg.model_config(), device=device), cfg, world_size, device)
    optimizers = _optimizers(model, cfg)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, _schedule(cfg)) for o in optimizers]
    sampler = BatchSampler(
        arithmetic_corpus(cfg.corpus_lines, seed=cfg.seed), cfg.seq_len, cfg.global_batch, seed=cfg.seed
    )
    bar = None
    if cfg.progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, desc=f"{cfg.layout}+{cfg.optimizer} W={world_size}", unit="step")
    records: list[dict[str, Any]] = []
    resident: dict[str, int] = {}
    profiled: dict[str, int] | None = None
    for step in range(cfg.steps):
        x, y = sampler.rank_batch(step, rank, world_size)
        x, y = x.to(device), y.to(device)
        prof = None
        if cfg.profile_step == step:
            from torch.profiler import ProfilerActivity, profile

            prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            with native_stderr_without_usdt():  # kineto's USDT markers are no output of ours
                prof.__enter__()
        synchronize(device)
        t0 = time.perf_counter()
        with CommCounter() as cc:
            with _phase_marker("forward"), comm_phase("forward"):
                loss = model(x, y)
            with _phase_marker("backward"), comm_phase("backward"):
                loss.backward()
            synchronize(device)
            t1 = time.perf_counter()
            with _phase_marker("optimizer"):
                for opt in optimizers:
                    opt.step()
            synchronize(device)
            t2 = time.perf_counter()
        if step == cfg.steps - 1:
            resident = resident_bytes(model, optimizers)
        for opt in optimizers:
            opt.zero_grad()
        for s in schedulers:
            s.step()
        if prof is not None:
            with native_stderr_without_usdt():
                prof.__exit__(None, None, None)
            profiled = _profiled_bytes(prof, world_size)
        loss_value, comm_bytes = float(loss.detach()), cc.by_phase()
        rec: dict[str, Any] = {
            "step": step,
            "loss": loss_value,
            "step_time_s": t2 - t0,
            "optimizer_time_s": t2 - t1,
            "comm": comm_bytes,
        }
        records.append(rec)
        if bar is not None:
            c = comm_bytes
            bar.set_postfix(
                loss=f"{loss_value:.3f}",
                step_ms=f"{1e3 * (t2 - t0):.0f}",
                opt_ms=f"{1e3 * (t2 - t1):.1f}",
                fwd_B=c["forward"]["bytes_sent"],
                bwd_B=c["backward"]["bytes_sent"],
                opt_B=c["optimizer"]["bytes_sent"],
            )
            bar.update(1)
    if bar is not None:
        bar.close()
    # global loss per step = mean of the ranks' micro-batch losses (what DDP averages)
    losses = torch.tensor([r["loss"] for r in records])
    if world_size > 1:
        comm.all_reduce(losses, name="loss_all_reduce")
        losses /= world_size
    for r, l in zip(records, losses.tolist(), strict=True):
        r["global_loss"] = l
    return {
        "rank": rank,
        "records": records,
        "resident_bytes": resident,
        "profiled_bytes": profiled,
        "config": asdict(cfg),
    }


class _phase_marker:
    """``record_function("phase:<name>")`` so profiler events can be attributed to a phase."""

    def __init__(self, name: str) -> None:
        from torch.profiler import record_function

        self._rf = record_function(f"phase:{name}")

    def __enter__(self) -> None:
        self._rf.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._rf.__exit__(*exc)


def _profiled_bytes(prof: Any, world_size: int) -> dict[str, int]:
    windows = phase_windows(prof)
    out = {}
    for phase in ("forward", "backward", "optimizer"):
        ops = [o for w in windows.get(phase, []) for o in backend_ops(prof, w)]
        out[phase] = sum(op_bytes(o, world_size) for o in ops)
        out[f"{phase}_ops"] = len(ops)
    return out


def summarize(results: list[dict[str, Any]], skip: int = 2) -> dict[str, Any]:
    """Medians over steps (after ``skip`` warm-up steps), per-rank bytes and residency."""
    W = len(results)
    recs0 = results[0]["records"]
    body = recs0[skip:] if len(recs0) > skip else recs0

    def med(key: str) -> float:
        return statistics.median(r[key] for r in body)

    per_rank = []
    for res in results:
        recs = res["records"][skip:] if len(res["records"]) > skip else res["records"]
        by_phase = {
            ph: statistics.median(r["comm"][ph]["bytes_sent"] for r in recs)
            for ph in ("forward", "backward", "optimizer", "other")
        }
        calls = {
            ph: statistics.median(r["comm"][ph]["calls"] for r in recs) for ph in ("forward", "backward", "optimizer")
        }
        per_rank.append(
            {
                "rank": res["rank"],
                "bytes_sent_per_step": by_phase,
                "calls_per_step": calls,
                "profiled_bytes": res["profiled_bytes"],
                "resident_bytes": res["resident_bytes"],
            }
        )
    return {
        "world_size": W,
        "first_loss": recs0[0]["global_loss"],
        "final_loss": recs0[-1]["global_loss"],
        "losses": [r["global_loss"] for r in recs0],
        "median_step_time_s": med("step_time_s"),
        "median_optimizer_time_s": med("optimizer_time_s"),
        "ranks": per_rank,
    }
