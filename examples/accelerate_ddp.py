"""Hugging Face Accelerate (its DDP path) with OwnerRoutedOptimizer: prepare, clip, save_state
and load_state.

    torchrun --nproc-per-node 2 examples/accelerate_ddp.py --steps 4 --out /tmp/acc      # 2 CPU processes
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_ddp.py --out /tmp/acc  # 2 GPUs
    python examples/accelerate_ddp.py --out /tmp/acc                                    # one process

(``accelerate launch --cpu`` starts a single process whatever ``--num_processes`` says: its
multi-CPU launch goes through mpirun. torchrun's environment is what Accelerate reads either way.)

Versus the stock Accelerate script one line changes: the optimizer. Under DDP every rank holds
the whole model; ``OwnerRoutedOptimizer`` gives each weight matrix an owner rank, runs Muon
there only and shares the new values (AdamW on the rest, on every rank). One more line is
needed to checkpoint: the Muon state of a matrix lives on its owner, so every rank calls
``consolidate_state_dict(to=None)`` before ``accelerator.save_state`` (as with torch's
``ZeroRedundancyOptimizer``). ``replicated="redundant"`` in the optimizer line instead updates
every matrix on every rank and needs no consolidation.

The script trains ``--steps`` steps on a tiny Llama built from a config (no download), saves
the state after ``--save-at`` steps (default: half way) and keeps going; then it plays a
restart: a fresh model (other random weights), optimizer, scheduler and dataloader are prepared,
``load_state`` restores them, the first batches are skipped, and training continues. It prints
both runs' losses and the largest difference of the final parameters (0 when everything came
back).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from matrix_owner_optim import OwnerRoutedOptimizer
from matrix_owner_optim.toolbox.launch import shutdown_process_groups

VOCAB, SEQ, BATCH_PER_RANK = 64, 16, 2


def build_model(seed: int) -> torch.nn.Module:
    """A tiny Llama (GQA: 4 query heads over 2 key/value heads), from a config, no download."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).float()


def dataset(n: int) -> list[dict[str, torch.Tensor]]:
    """Counting sequences mod VOCAB (learnable), from fixed seeds: the same on every rank."""
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, VOCAB, (n, 1), generator=g)
    seqs = (starts + torch.arange(SEQ)) % VOCAB
    return [{"input_ids": s, "labels": s} for s in seqs]


def build(accelerator: Accelerator, seed: int, steps: int) -> tuple[Any, Any, Any, Any]:
    model = build_model(seed)
    # --8<-- [start:optimizer]
    # stock: optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    optimizer = OwnerRoutedOptimizer(
        model,
        matrix="muon",
        matrix_options={"lr": 0.02},  # <- the one line that changes
        tail="adamw",
        tail_options={"lr": 3e-3},
    )
    # --8<-- [end:optimizer]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - 0.5 * s / steps)
    # the loader yields the global batch split over the ranks (BATCH_PER_RANK rows each)
    loader = DataLoader(dataset(steps * BATCH_PER_RANK * accelerator.num_processes), batch_size=BATCH_PER_RANK)
    return accelerator.prepare(model, optimizer, loader, scheduler)


def train(
    accelerator: Accelerator,
    model: Any,
    optimizer: Any,
    loader: Any,
    scheduler: Any,
    start: int,
    save: tuple[int, str] | None = None,
) -> list[float]:
    """One step per batch of ``loader`` (numbered from ``start``); the global mean loss of each.
    ``save=(steps, dir)``: ``accelerator.save_state(dir)`` after that many steps."""
    losses = []
    for step, batch in enumerate(loader, start):
        loss = model(**batch).loss
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), reduction="mean")))
        accelerator.print(f"  step {step}: loss {losses[-1]:.4f}  grad norm {float(norm):.3f}")
        if save is not None and step + 1 == save[0]:
            # --8<-- [start:save]
            optimizer.optimizer.consolidate_state_dict(to=None)  # the matrices' state, from their owners
            accelerator.save_state(save[1])
            # --8<-- [end:save]
            accelerator.print(f"  saved state after {step + 1} steps to {save[1]}")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=None, help="save after this step (default: steps // 2)")
    parser.add_argument("--out", required=True, help="directory of accelerator.save_state")
    args = parser.parse_args()
    save_at = args.steps // 2 if args.save_at is None else args.save_at
    if not 0 < save_at < args.steps:
        parser.error(f"--save-at must lie in 1..{args.steps - 1} (steps - 1), got {save_at}")

    run(args, save_at)
    # In place of accelerator.end_training() (no trackers here): run() has returned, so the
    # models and optimizers are garbage; this collects them while the process group is still
    # registered, then destroys it and checks that gloo's worker threads are gone. A thread
    # still running at interpreter exit can abort the process ("terminate called without an
    # active exception") after all the work is done.
    shutdown_process_groups()


def run(args: argparse.Namespace, save_at: int) -> None:
    """Both runs, and what they print (the main process)."""
    # one GPU per local process where there are enough, else CPU processes (gloo)
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    accelerator = Accelerator(cpu=torch.cuda.device_count() < max(1, local_processes))
    accelerator.print(f"uninterrupted run ({accelerator.distributed_type}, {accelerator.num_processes} processes):")
    model, optimizer, loader, scheduler = build(accelerator, seed=0, steps=args.steps)
    straight = train(accelerator, model, optimizer, loader, scheduler, 0, save=(save_at, args.out))
    final = {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}
    accelerator.free_memory(model, optimizer, loader, scheduler)  # as between two trainings

    accelerator.print(f"resumed run (fresh model, optimizer, scheduler, dataloader; state after {save_at} steps):")
    model, optimizer, loader, scheduler = build(accelerator, seed=1, steps=args.steps)  # other weights
    accelerator.load_state(args.out)
    resumed = train(accelerator, model, optimizer, accelerator.skip_first_batches(loader, save_at), scheduler, save_at)
    diff = max(
        float((final[n] - p.detach()).abs().max()) for n, p in accelerator.unwrap_model(model).named_parameters()
    )
    accelerator.print(f"resumed from step {save_at}: losses {' '.join(f'{v:.6f}' for v in resumed)}")
    accelerator.print(f"uninterrupted, same steps: losses {' '.join(f'{v:.6f}' for v in straight[save_at:])}")
    accelerator.print(f"final loss: uninterrupted {straight[-1]:.6f} resumed {resumed[-1]:.6f}")
    accelerator.print(f"max |param diff| resumed vs uninterrupted: {diff:.3e}")
    # no accelerator.end_training() here: it destroys the process group while the DDP model
    # still lives, leaving DDP's C++ Reducer the group's last owner; freeing the model later
    # then joins gloo's threads holding the GIL, which one of them may need (a hang, seen 1 in ~10)


if __name__ == "__main__":
    main()
