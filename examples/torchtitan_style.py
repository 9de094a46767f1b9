"""torchtitan's training loop on the owner layout: FSDP2 call pattern, torchtitan-style param
groups, an LR schedule, gradient clipping, and a DCP checkpoint that a fresh job resumes from.

    torchrun --nproc-per-node 2 examples/torchtitan_style.py --steps 6 --ckpt /tmp/ckpt

Versus the stock torchtitan setup (``torch.distributed.fsdp.fully_shard`` + AdamW) one line
changes: the optimizer (``OwnerRoutedOptimizer``: Muon on the blocks' weight matrices, AdamW
on embeddings, the tied head, norms and biases). Importing ``fully_shard`` from
``matrix_owner_optim`` instead of torch is the second, optional, change: it gives each matrix
whole to one rank (its owner), so Muon's step moves zero bytes. ``--layout fsdp2`` keeps
torch's ``fully_shard`` and the same optimizer line.

The script trains ``--steps`` steps and saves a checkpoint after step ``--save-at`` (default:
half way), as a long run does periodically. It then plays a restart: a fresh model (other
random weights), optimizer and scheduler load that checkpoint and train the remaining steps.
It prints both runs' losses and the largest difference of the final parameters (0 when the
model, the optimizer state and the schedule all came back).

With a GPU for every local rank each rank takes the GPU of its LOCAL_RANK and NCCL; else CPU
ranks and gloo.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from matrix_owner_optim import OwnerRoutedOptimizer
from matrix_owner_optim.toolbox.launch import shutdown_process_groups
from matrix_owner_optim.toolbox.models.gpt import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, d_model=32, n_heads=2)
BATCH_PER_RANK = 4
WARMUP = 2


def build_model(seed: int, layout: str, mesh: DeviceMesh) -> GPT:
    """A small GPT, sharded as torchtitan shards a decoder: every block, then the root."""
    # --8<-- [start:shard]
    if layout == "owner":
        from matrix_owner_optim import fully_shard  # <- optional: the owner layout (0-byte optimizer step)
    else:
        from torch.distributed.fsdp import fully_shard  # stock FSDP2; the optimizer line is the same
    torch.manual_seed(seed)
    model = GPT(CONFIG).to(mesh.device_type)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # --8<-- [end:shard]
    return model


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Groups in the form torchtitan's ``OptimizersContainer`` builds: ``params`` with their
    ``param_names`` (the FQNs its checkpoint keys the optimizer state by) and the
    implementation flags; here weight decay on matrices and embeddings, none on norms and biases."""
    decay = [(n, p) for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [(n, p) for n, p in model.named_parameters() if p.ndim < 2]
    return [
        {
            "params": [p for _, p in g],
            "param_names": [n for n, _ in g],
            "fused": False,
            "foreach": False,
            "weight_decay": wd,
        }
        for g, wd in ((decay, 0.01), (no_decay, 0.0))
    ]


def build_optimizer(model: torch.nn.Module, steps: int) -> tuple[torch.optim.Optimizer, Any]:
    groups = param_groups(model)
    # --8<-- [start:optimizer]
    # stock: opt = torch.optim.AdamW(groups, lr=3e-3)
    opt = OwnerRoutedOptimizer(
        groups,
        matrix="muon",
        matrix_options={"lr": 0.02},  # <- the one line that changes
        tail="adamw",
        tail_options={"lr": 3e-3},
    )
    # --8<-- [end:optimizer]
    # torchtitan's schedule: linear warmup, then linear decay (each group scales its own lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / WARMUP, max(0.1, (steps - s) / max(1, steps - WARMUP)))
    )
    return opt, sched


def batch(step: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch: counting sequences mod vocab (learnable), seeded by step and rank."""
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    start = torch.randint(0, CONFIG.vocab_size, (BATCH_PER_RANK, 1), generator=g)
    seq = (start + torch.arange(CONFIG.seq_len + 1)) % CONFIG.vocab_size
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    start: int,
    stop: int,
    device: str,
    save: tuple[int, str] | None = None,
) -> list[float]:
    """Steps ``start .. stop-1``; the global mean loss of each. ``save=(step, dir)``: a DCP
    checkpoint of model, optimizer, schedule and step count after that step."""
    losses = []
    for step in range(start, stop):
        x, y = batch(step, device)
        loss = model(x, y)
        loss.backward()
        # the global norm over every rank's gradients (parameters are DTensors on both layouts)
        # --8<-- [start:clip]
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        # --8<-- [end:clip]
        lr = opt.param_groups[0]["lr"]  # the matrix group's lr this step
        opt.step()
        opt.zero_grad()
        sched.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
        if dist.get_rank() == 0:
            print(
                f"  step {step}: loss {losses[-1]:.4f}  grad norm {float(norm.full_tensor()):.3f}  lr {lr:.4f}",
                flush=True,
            )
        if save is not None and step + 1 == save[0]:
            # --8<-- [start:save]
            state = {
                "model": get_model_state_dict(model),
                "optimizer": get_optimizer_state_dict(model, opt),
                "lr_scheduler": sched.state_dict(),
                "step": step + 1,
            }
            dcp.save(state, checkpoint_id=save[1])
            # --8<-- [end:save]
            if dist.get_rank() == 0:
                print(f"  saved checkpoint after {step + 1} steps to {save[1]}", flush=True)
    return losses


def resume(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, ckpt: str) -> int:
    """Load a checkpoint into a fresh model, optimizer and scheduler; return the next step.
    ``dcp.load`` fills the given state dicts in place, each rank reading only its pieces."""
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, opt),
        "lr_scheduler": sched.state_dict(),
        "step": 0,
    }
    # --8<-- [start:load]
    dcp.load(state, checkpoint_id=ckpt)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optimizer"])
    # --8<-- [end:load]
    sched.load_state_dict(state["lr_scheduler"])
    return int(state["step"])


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole on every rank (collective)."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {n: t.detach().cpu().clone() for n, t in sd.items()}


def run(args: argparse.Namespace, save_at: int, device: str) -> None:
    """Both runs, and what they print (rank 0). Models and optimizers live in this frame only,
    so that they are garbage when it returns (see ``main``)."""
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"uninterrupted run ({args.layout} layout, {dist.get_world_size()} ranks, {device}):", flush=True)
    model = build_model(seed=0, layout=args.layout, mesh=mesh)
    opt, sched = build_optimizer(model, args.steps)
    straight = train(model, opt, sched, 0, args.steps, device, save=(save_at, args.ckpt))
    final = full_params(model)

    if rank0:
        print(f"resumed run (fresh model, optimizer and schedule; checkpoint after {save_at} steps):", flush=True)
    model = build_model(seed=1, layout=args.layout, mesh=mesh)  # other weights: the load must set them
    opt, sched = build_optimizer(model, args.steps)
    start = resume(model, opt, sched, args.ckpt)
    resumed = train(model, opt, sched, start, args.steps, device)
    diff = max(float((final[n] - t).abs().max()) for n, t in full_params(model).items())
    if rank0:
        print(f"resumed from step {start}: losses {' '.join(f'{v:.6f}' for v in resumed)}")
        print(f"uninterrupted, same steps: losses {' '.join(f'{v:.6f}' for v in straight[start:])}")
        print(f"final loss: uninterrupted {straight[-1]:.6f} resumed {resumed[-1]:.6f}")
        print(f"max |param diff| resumed vs uninterrupted: {diff:.3e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=None, help="checkpoint after this step (default: steps // 2)")
    parser.add_argument("--ckpt", required=True, help="directory of the DCP checkpoint")
    parser.add_argument("--layout", choices=("owner", "fsdp2"), default="owner")
    args = parser.parse_args()
    save_at = args.steps // 2 if args.save_at is None else args.save_at
    if not 0 < save_at < args.steps:
        parser.error(f"--save-at must lie in 1..{args.steps - 1} (steps - 1), got {save_at}")

    # one GPU per local rank (NCCL) where there are enough, else CPU ranks (gloo)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = "cuda" if torch.cuda.device_count() >= max(1, local_ranks) else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        run(args, save_at, device)
    finally:
        # Not just dist.destroy_process_group(): gloo's worker threads stop only when nothing
        # references the group any more, and one still running at interpreter exit can abort
        # the rank ("terminate called without an active exception") after all the work is
        # done. This collects the dead models and optimizers, clears DTensor's mesh caches,
        # destroys the group and checks that its threads are gone.
        shutdown_process_groups()


if __name__ == "__main__":
    main()
